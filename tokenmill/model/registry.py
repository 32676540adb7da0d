"""Maps `config.architectures[0]` to the module class that implements it."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from torch import nn

from tokenmill.model.llama import LlamaForCausalLM

MODEL_CLASSES: MappingProxyType[str, type[nn.Module]] = MappingProxyType({
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
})


def supported_architectures() -> tuple[str, ...]:
    return tuple(MODEL_CLASSES)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    arch = architectures[0] if architectures else None
    model_cls = MODEL_CLASSES.get(arch) if arch else None
    if model_cls is None:
        raise ValueError(f"model architecture {arch!r} is not supported; "
                         f"supported architectures: {', '.join(MODEL_CLASSES)}")
    return model_cls
