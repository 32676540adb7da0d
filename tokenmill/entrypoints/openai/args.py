"""`tokenmill serve` flags beyond the engine's, and the frozen settings the app runs with."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

API_KEY_ENV = "TOKENMILL_API_KEY"


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    public_metrics: bool = False  # /metrics readable without the API key
    enable_debug_routes: bool = False  # GET /debug/engine (engine stats, for leak checks)
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 16 << 10
    max_n: int = 128
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_stop: int = 16  # stop strings in one request
    max_stop_chars: int = 256  # characters in one stop string
    max_stop_token_ids: int = 256
    max_logit_bias: int = 1024  # entries in logit_bias
    max_messages: int = 1024  # chat messages in one request
    max_queued_requests: int = 256  # sequences waiting beyond max_num_seqs before 503
    shutdown_timeout: float = 30.0
    uvicorn_log_level: str = "info"
    enable_auto_tool_choice: bool = False  # tool_choice "auto": calls read by tool_call_parser
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral | qwen3_xml
    lora_modules: tuple[str, ...] = ()  # NAME=PATH of LoRA adapters served from the start (--enable-lora)
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter


_HELP = {
    "host": "address to bind",
    "port": "TCP port to bind",
    "api_key": f"require 'Authorization: Bearer KEY' on every non-public route (or set {API_KEY_ENV})",
    "public_metrics": "serve /metrics without the API key",
    "enable_debug_routes": "serve GET /debug/engine (engine request and KV block counts)",
    "max_body_bytes": "largest request body; larger ones get 413",
    "max_header_bytes": "largest total size of request headers; larger ones get 431",
    "max_n": "largest n (choices per prompt)",
    "max_prompts": "most prompts in one completions request",
    "max_stop": "most stop strings in one request",
    "max_stop_chars": "longest stop string, in characters",
    "max_stop_token_ids": "most stop_token_ids in one request",
    "max_logit_bias": "most logit_bias entries in one request",
    "max_messages": "most chat messages in one request",
    "max_queued_requests": "sequences admitted beyond --max-num-seqs; further requests get 503",
    "shutdown_timeout": "seconds in-flight requests get to finish after SIGTERM/SIGINT before they are aborted",
    "uvicorn_log_level": "uvicorn's log level",
    "enable_auto_tool_choice": 'let requests use tool_choice "auto" (needs --tool-call-parser)',
    "tool_call_parser": "how the model writes tool calls: hermes, llama3_json, mistral or qwen3_xml",
    "lora_modules": "LoRA adapters to serve, as NAME=PATH (PEFT folders; needs --enable-lora); a request's "
                    "`model` names one",
    "allow_runtime_lora_updating": "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
}


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    for f in fields(ServerSettings):
        name, default = f.name, f.default
        flag = "--" + name.replace("_", "-")
        if isinstance(default, tuple):
            parser.add_argument(flag, nargs="*", default=default, help=_HELP[name])
        elif isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=f"{_HELP[name]} (default: {'on' if default else 'off'})")
        else:
            kind = type(default) if default is not None else str
            parser.add_argument(flag, type=kind, default=default, help=f"{_HELP[name]} (default: {default})")


def settings_from_flags(ns: argparse.Namespace) -> ServerSettings:
    values = {f.name: getattr(ns, f.name) for f in fields(ServerSettings)}
    values["lora_modules"] = tuple(values["lora_modules"] or ())
    if values["api_key"] is None:
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    settings = ServerSettings(**values)
    check_settings(settings)
    return settings


def check_settings(s: ServerSettings) -> None:
    for name in ("max_body_bytes", "max_header_bytes", "max_n", "max_prompts", "max_stop", "max_stop_chars",
                 "max_logit_bias", "max_messages"):
        if getattr(s, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(s, name)}")
    for name in ("max_queued_requests", "max_stop_token_ids"):
        if getattr(s, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(s, name)}")
    if not 0 <= s.port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {s.port}")
    if s.shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout must be >= 0, got {s.shutdown_timeout}")
    if s.enable_auto_tool_choice and s.tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs --tool-call-parser")
    if s.tool_call_parser is not None:
        from tokenmill.entrypoints.openai.tool_parsers import PARSERS
        if s.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {s.tool_call_parser!r}")
    for module in s.lora_modules:
        if "=" not in module or not module.split("=", 1)[0] or not module.split("=", 1)[1]:
            raise ValueError(f"lora_modules: {module!r} must be NAME=PATH")
    if s.api_key is not None and not s.api_key:
        raise ValueError("api_key must not be empty")
