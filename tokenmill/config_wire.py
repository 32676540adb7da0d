"""A resolved `EngineConfig` as plain values, so the engine-core process need not resolve it again.

Resolving a config loads the model's Hugging Face config, which imports transformers: seconds
per process. The engine core never needs `hf_config`, so the front-end sends the config it
resolved (minus `hf_config`) and the core rebuilds it here; workers, which build the model,
resolve their own. Walks the dataclasses generically: a new plain field needs no change here.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import torch

from tokenmill.config import EngineConfig

_SKIPPED = ("hf_config",)  # rebuilt as None


def config_to_wire(config: EngineConfig) -> dict[str, Any]:
    return _encode(config)


def config_from_wire(data: dict[str, Any]) -> EngineConfig:
    return _decode(EngineConfig, data)


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.name not in _SKIPPED}
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"config value {value!r} of type {type(value).__name__} has no wire form")


def _decode(cls: type, data: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in _SKIPPED:
            values[f.name] = None
        elif f.name in data:
            values[f.name] = _decode_value(hints[f.name], data[f.name])
    return cls(**values)


def _decode_value(hint: Any, value: Any) -> Any:
    if dataclasses.is_dataclass(hint):
        return _decode(hint, value)
    if hint is torch.dtype:
        return getattr(torch, value)
    if hint is torch.device:
        return torch.device(value)
    if typing.get_origin(hint) is tuple:
        return tuple(value)
    return value
