"""The FastAPI app: routes, error handlers and the request guard, around one AsyncLLM."""

from __future__ import annotations

import asyncio
from typing import Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import tokenmill
from tokenmill.entrypoints.openai import lora_routes, serving_chat, serving_completions
from tokenmill.entrypoints.openai.admission import Admission
from tokenmill.entrypoints.openai.args import ServerSettings
from tokenmill.entrypoints.openai.chat_template import render_chat
from tokenmill.entrypoints.openai.errors import APIError, error_response, from_value_error, install_error_handlers
from tokenmill.entrypoints.openai.limits import KNOWN_FIELDS, check_message_count
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.schemas import (DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
                                                  TokenizeChatRequest, TokenizeCompletionRequest,
                                                  TokenizeResponse)
from tokenmill.entrypoints.openai.security import GuardMiddleware
from tokenmill.entrypoints.openai.state import ServerState, get_state
from tokenmill.errors import EngineDeadError
from tokenmill.frontend.async_llm import AsyncLLM

_STATS_TIMEOUT_S = 10.0
_HEALTH_TIMEOUT_S = 5.0  # an idle engine answers a utility call at once


def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    config = engine.config
    capacity = config.scheduler.max_num_seqs + settings.max_queued_requests
    k = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    state = ServerState(engine=engine, settings=settings, admission=Admission(capacity),
                        metrics=ServerMetrics(config.model.name, k), model_name=config.model.name,
                        max_model_len=config.model.max_model_len)
    state.frontend.input_processor.grammars.on_compiled = state.metrics.grammar_compiled
    app = FastAPI(title="tokenmill", version=tokenmill.__version__,
                  description="OpenAI-compatible API of the tokenmill inference engine")
    state.loras = lora_routes.LoRARegistry(engine.frontend, state.model_name)
    for module in settings.lora_modules:  # a bad adapter stops the server from starting, naming it
        name, path = module.split("=", 1)
        try:
            state.loras.add(name, path)
        except APIError as exc:
            raise ValueError(f"lora_modules: {exc.message}") from None
    app.state.tokenmill = state
    install_error_handlers(app)
    if settings.allow_runtime_lora_updating:
        app.include_router(lora_routes.router)
    app.include_router(serving_completions.router)
    app.include_router(serving_chat.router)
    _add_routes(app, settings.enable_debug_routes)
    app.add_middleware(GuardMiddleware, settings=settings)
    return app


def _add_routes(app: FastAPI, debug: bool) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 while the engine serves. 503 when shutting down, when the engine is dead, when
        requests have been pending with no step finished for longer than step_timeout (stalled),
        or when an idle engine does not answer within _HEALTH_TIMEOUT_S."""
        state = get_state(request)
        engine = state.engine
        if state.admission.draining:
            return error_response(503, "the server is shutting down", code="shutting_down")
        if engine.dead_error is not None:
            return error_response(503, "the engine is not running", code="engine_dead")
        stalled, limit = engine.stalled_for(), engine.config.step_timeout_s
        if stalled > limit:
            return error_response(503, f"no engine step finished for {stalled:.0f} s with requests pending "
                                       f"(step_timeout {limit:g} s)", code="engine_stalled")
        if stalled > 0:
            return Response(status_code=200)  # busy, and its steps are finishing
        try:
            await asyncio.wait_for(engine.scheduler_stats(), _HEALTH_TIMEOUT_S)
        except EngineDeadError:
            return error_response(503, "the engine is not running", code="engine_dead")
        except asyncio.TimeoutError:
            return error_response(503, f"the engine did not answer within {_HEALTH_TIMEOUT_S:g} s",
                                  code="engine_not_responding")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": tokenmill.__version__}

    @app.get("/v1/models", response_model=ModelList)
    async def models(request: Request) -> ModelList:
        state = get_state(request)
        card = ModelCard(id=state.model_name, created=state.started, root=state.engine.config.model.path,
                         max_model_len=state.max_model_len)
        adapters = [ModelCard(id=lora.lora_name, created=state.started, root=lora.lora_path, parent=state.model_name,
                              max_model_len=state.max_model_len) for lora in (state.loras.adapters.values() if state.loras else ())]
        return ModelList(data=[card, *adapters])

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state = get_state(request)
        try:
            stats = await asyncio.wait_for(state.engine.scheduler_stats(), _STATS_TIMEOUT_S)
            state.metrics.update_engine(stats)
        except (EngineDeadError, asyncio.TimeoutError):
            pass  # the front-end figures are still worth serving
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: Union[TokenizeCompletionRequest, TokenizeChatRequest], request: Request) -> dict:
        state = get_state(request)
        state.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            check_message_count(len(body.messages), state.settings)
            ids = render_chat(state.frontend, body.messages, body.add_generation_prompt,
                              body.continue_final_message, body.chat_template_kwargs)["prompt_token_ids"]
        else:
            ids = state.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        state = get_state(request)
        state.check_model(body.model)
        try:
            state.frontend.input_processor.check_token_ids(body.tokens, "tokens")
        except ValueError as exc:
            raise from_value_error(exc, KNOWN_FIELDS) from None
        return {"prompt": state.tokenizer.decode(body.tokens)}

    if debug:
        @app.get("/debug/engine")
        async def debug_engine(request: Request) -> JSONResponse:
            """Engine request and KV block counts (for leak checks); only with --enable-debug-routes."""
            state = get_state(request)
            kv = await asyncio.wait_for(state.engine.kv_cache_stats(), _STATS_TIMEOUT_S)
            sched = await asyncio.wait_for(state.engine.scheduler_stats(), _STATS_TIMEOUT_S)
            return JSONResponse({"kv_cache": kv, "scheduler": sched,
                                 "admitted_sequences": state.admission.num_seqs})
