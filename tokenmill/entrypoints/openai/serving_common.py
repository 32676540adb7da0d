"""What completions and chat share: preparing a prompt (its ValueErrors are 400s), usage, ids,
running to the end or streaming (any failure then is the server's: a logged 500, or 503)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.entrypoints.openai.errors import error_body, from_exception, from_value_error
from tokenmill.entrypoints.openai.generation import ChoiceDelta, Generation
from tokenmill.entrypoints.openai.limits import KNOWN_FIELDS, context_length_error
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.entrypoints.openai.streaming import DONE_EVENT, ClientGone, SSEResponse, sse, until_disconnect
from tokenmill.frontend.input_processor import PreparedRequest, Prompt
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(gen: Generation) -> dict[str, int]:
    p, c = gen.prompt_tokens, gen.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def prepare(state: ServerState, prompt: Prompt, params: SamplingParams, prompt_name: str,
            aliases: Mapping[str, str] | None = None, lora: LoRARequest | None = None) -> PreparedRequest:
    """The engine's one check of the request, before any work: a ValueError is a 400 naming the
    field (`aliases`: engine fields this API names otherwise), a prompt too long for the context
    is OpenAI's context_length_exceeded."""
    try:
        prepared = state.frontend.prepare(prompt, params, lambda overflow: context_length_error(overflow, prompt_name))
        return prepared.with_lora(state.frontend.lora_ref(lora))  # `lora`: the adapter `model` named
    except ValueError as exc:
        raise from_value_error(exc, KNOWN_FIELDS, aliases) from None


async def check_grammar(state: ServerState, params: SamplingParams, aliases: Mapping[str, str] | None = None) -> None:
    """A structured output's grammar compiles within the limits (a 400 naming the problem otherwise),
    off the event loop."""
    if params.structured_outputs is None:
        return
    try:
        await state.frontend.check_grammar(params)
    except ValueError as exc:
        raise from_value_error(exc, KNOWN_FIELDS, aliases) from None
    state.metrics.structured_request()


async def run_to_end(request: Request, state: ServerState, gen: Generation, render: Callable[[], dict]) -> Response:
    ticket = state.admission.admit(gen.request_ids, len(gen.choices))
    with ticket:
        try:
            await until_disconnect(request, gen.run())
        except ClientGone:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - EngineDeadError (503) and bugs (logged 500), in OpenAI's shape
            raise from_exception(exc) from None
    return JSONResponse(render())


def stream(state: ServerState, gen: Generation,
           render_step: Callable[[list[ChoiceDelta]], list[dict]], render_usage: Callable[[], dict] | None,
           prelude: list[dict] | None = None) -> SSEResponse:
    """The SSE response: `prelude` events, one or more per engine step, an optional usage event,
    then [DONE]. A failure after streaming began is sent as an error event before [DONE]."""
    ticket = state.admission.admit(gen.request_ids, len(gen.choices))

    async def events() -> AsyncIterator[bytes]:
        try:
            for chunk in prelude or ():
                yield sse(chunk)
            async for deltas in gen.steps():
                for chunk in render_step(deltas):
                    yield sse(chunk)
            if render_usage is not None:
                yield sse(render_usage())
        except Exception as exc:  # noqa: BLE001 - reported to the client in OpenAI's shape (bugs logged)
            err = from_exception(exc)
            yield sse(error_body(err.status, err.message, err.param, err.code))
        yield DONE_EVENT

    return SSEResponse(events(), ticket.release)
