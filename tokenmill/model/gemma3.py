"""Gemma 3, text (Gemma3ForCausalLM; Gemma3ForConditionalGeneration's language model).

Gemma 2's layers (`model/gemma2.py`) plus q/k norms (Gemma RMSNorm over each head) and no
attention soft-capping; five sliding-window layers to one global (`layer_types`), the local ones
with their own rotary base (`rope_parameters["sliding_attention"]`, legacy
`rope_local_base_freq`), which `model/arch.py` puts in each layer's `AttentionSpec.rope`.
For Gemma3ForConditionalGeneration only the text weights are read (`model.language_model.*`);
the vision tower and projector are skipped, so the model runs text-only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tokenmill.model.gemma2 import Gemma2ForCausalLM
from tokenmill.model.weight_source import LazyTensor

_TEXT_PREFIX = "model.language_model."
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's module: the q/k norms come from `ModelArch.qk_norm`, the local rope from the layer specs."""


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text part of the multimodal checkpoint."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None:
        def text_only():
            for name, tensor in weights:
                if name.startswith(_VISION_PREFIXES):
                    continue
                if name.startswith(_TEXT_PREFIX):
                    name = "model." + name[len(_TEXT_PREFIX):]
                elif name.startswith("language_model.model."):  # older layout
                    name = name[len("language_model."):]
                elif name == "language_model.lm_head.weight":
                    name = "lm_head.weight"
                yield name, tensor
        super().load_weights(text_only())
