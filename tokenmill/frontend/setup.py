"""What every front-end (LLM, AsyncLLM) builds before it starts an engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.config import EngineArgs, EngineConfig
from tokenmill.frontend.engine_config import resolve_engine_config
from tokenmill.frontend.input_processor import InputProcessor
from tokenmill.frontend.output_processor import OutputProcessor
from tokenmill.model.tokenizer import load_tokenizer


@dataclass(frozen=True)
class FrontendParts:
    engine_args: EngineArgs
    config: EngineConfig
    tokenizer: Any
    input_processor: InputProcessor
    output_processor: OutputProcessor


def build_frontend(model: str, kwargs: dict[str, Any]) -> FrontendParts:
    """Resolve and validate the engine arguments here, so bad ones fail before any process starts."""
    unknown = set(kwargs) - set(EngineArgs.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
    engine_args = EngineArgs(model=model, **kwargs)
    config = resolve_engine_config(engine_args)
    tokenizer = load_tokenizer(config.model.path)
    return FrontendParts(engine_args, config, tokenizer, InputProcessor(config, tokenizer),
                         OutputProcessor(tokenizer))
