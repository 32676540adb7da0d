"""What completions and chat share: turning engine ValueErrors into 400s, usage, ids, SSE endings."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.entrypoints.openai.errors import error_body, from_exception, from_value_error
from tokenmill.entrypoints.openai.generation import ChoiceDelta, Generation, PromptInput
from tokenmill.entrypoints.openai.limits import KNOWN_FIELDS, completion_budget
from tokenmill.entrypoints.openai.state import ServerState
from tokenmill.entrypoints.openai.streaming import DONE_EVENT, ClientGone, SSEResponse, sse, until_disconnect


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(gen: Generation) -> dict[str, int]:
    p, c = gen.prompt_tokens, gen.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def prepare_prompt(state: ServerState, text: str | None, ids: list[int], requested_max_tokens: int | None,
                   make_params: Callable[[int], object], prompt_name: str) -> PromptInput:
    """Checks the context window and the engine's own validation, before any work."""
    max_tokens = completion_budget(len(ids), requested_max_tokens, state.max_model_len, prompt_name)
    params = make_params(max_tokens)
    try:
        state.engine.input_processor.validate(ids, params)
    except ValueError as exc:
        raise from_value_error(exc, KNOWN_FIELDS) from None
    return PromptInput(text, ids, params)


async def run_to_end(request: Request, state: ServerState, gen: Generation, render: Callable[[], dict]) -> Response:
    ticket = state.admission.admit(gen.request_ids, len(gen.choices))
    with ticket:
        try:
            await until_disconnect(request, gen.run())
        except ClientGone:
            return Response(status_code=499)
        except ValueError as exc:
            raise from_value_error(exc, KNOWN_FIELDS) from None
        except Exception as exc:  # noqa: BLE001 - EngineDeadError and the unexpected, in OpenAI's shape
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
        except ValueError as exc:
            err = from_value_error(exc, KNOWN_FIELDS)
            yield sse(error_body(err.status, err.message, err.param, err.code))
        except Exception as exc:  # noqa: BLE001 - reported to the client in OpenAI's shape
            err = from_exception(exc)
            yield sse(error_body(err.status, err.message, err.param, err.code))
        yield DONE_EVENT

    return SSEResponse(events(), ticket.release)
