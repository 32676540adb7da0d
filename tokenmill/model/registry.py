"""Maps a HF architecture name (`config.architectures[0]`) to the module class that implements it."""

from __future__ import annotations

from types import MappingProxyType

from torch import nn

from tokenmill.model.deepseek import DeepseekForCausalLM
from tokenmill.model.gemma2 import Gemma2ForCausalLM
from tokenmill.model.gpt_oss import GptOssForCausalLM
from tokenmill.model.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.mixtral import MixtralForCausalLM
from tokenmill.model.olmoe import OlmoeForCausalLM
from tokenmill.model.phi3 import Phi3ForCausalLM
from tokenmill.model.qwen_moe import QwenMoeForCausalLM

MODEL_CLASSES: MappingProxyType[str, type[nn.Module]] = MappingProxyType({
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    # mixture-of-experts (tokenmill/layers/moe)
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": QwenMoeForCausalLM,
    "Qwen3MoeForCausalLM": QwenMoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    # multi-head latent attention + MoE
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
})


def supported_architectures() -> tuple[str, ...]:
    return tuple(MODEL_CLASSES)


def check_architecture(architecture: str | None) -> str:
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"model architecture {architecture!r} is not supported; "
                         f"supported architectures: {', '.join(MODEL_CLASSES)}")
    return architecture


def get_model_class(architecture: str) -> type[nn.Module]:
    return MODEL_CLASSES[check_architecture(architecture)]
