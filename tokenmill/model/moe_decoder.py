"""What the mixture-of-experts families share over the Llama module: a decoder layer built from
its parts, and the loading of expert weights.

Expert weights arrive per expert (`mlp.experts.3.gate_proj.weight`; Mixtral's `w1`/`w3`/`w2`
under `block_sparse_moe`), fused (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I],
as transformers 5 holds them) or under our own names (dummy weights); each lands in its slice of
the stacked `experts.w13` [E, 2 * I_local, H] and `experts.w2` [E, H, I_local]: this rank's rows
of every expert's gate and up, and its columns of down. Shared experts likewise. Everything else
goes through the Llama loader.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenmill.config import ModelArch
from tokenmill.layers.moe.layer import SparseMoE
from tokenmill.layers.norm import RMSNorm
from tokenmill.distributed.parallel_state import ParallelContext
from tokenmill.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from tokenmill.model.weight_source import LazyTensor, read_slice, tensor_shape

_PER_EXPERT = re.compile(r"^(?P<mlp>.*\.mlp)\.experts\.(?P<expert>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = re.compile(r"^(?P<mlp>.*\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj|w13|w2)$")
_SHARED = re.compile(r"^(?P<mlp>.*\.mlp)\.(?:shared_expert|shared_experts)\."
                     r"(?P<proj>gate_proj|up_proj|down_proj|gate_up|down)\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


class MoEDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer (same forward: norms, residual handling) with the family's attention
    (`attention_cls`) and layer `layer`'s MLP (`make_mlp`)."""

    attention_cls: type[nn.Module] = LlamaAttention

    def __init__(self, dims: ModelArch, attn_backend_cls: type, parallel: ParallelContext, layer: int = 0) -> None:
        nn.Module.__init__(self)
        self.self_attn = self.attention_cls(dims, attn_backend_cls, parallel, layer)
        self.mlp = make_mlp(dims, parallel, layer)
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)


def make_mlp(dims: ModelArch, parallel, index: int) -> nn.Module:
    """Layer `index`'s MLP: the sparse MoE, or a dense one where the config says so."""
    assert dims.moe is not None
    if index in dims.moe.dense_layers:
        return LlamaMLP(dims, parallel)
    return SparseMoE(dims.hidden_size, dims.moe, parallel)


class MoEModel(LlamaModel):
    layer_cls = MoEDecoderLayer


class MoECausalLM(LlamaForCausalLM):
    """LlamaForCausalLM over MoE decoder layers (Llama attention unless a family's `model_cls`
    says otherwise), with the expert loader."""

    model_cls = MoEModel

    # HF module-name prefixes renamed before loading (Mixtral's block_sparse_moe -> mlp).
    renames: tuple[tuple[str, str], ...] = ()

    def _loaded_elsewhere(self, name: str) -> bool:
        return ".experts." in name or ".shared_expert." in name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None:
        params = dict(self.named_parameters())
        pending = {(name, part) for name in params if self._loaded_elsewhere(name)
                   for part in self._parts_of(name, params[name])}
        super().load_weights(self._take_experts(weights, params, pending))
        if pending:
            shown = sorted(f"{name}[{part}]" for name, part in pending)
            raise ValueError(f"missing expert weights: {', '.join(shown[:8])}"
                             f"{' ...' if len(shown) > 8 else ''}")

    def _parts_of(self, name: str, param: torch.Tensor) -> list[str]:
        if name.endswith("experts.w13"):
            return [f"{p}{e}" for e in range(param.shape[0]) for p in ("gate", "up")]
        if name.endswith("experts.w2"):
            return [f"down{e}" for e in range(param.shape[0])]
        return ["gate", "up"] if name.endswith("gate_up.weight") else ["down"]

    def _take_experts(self, weights, params, pending) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
        """Loads expert and shared-expert tensors; yields the rest (renamed) to the Llama loader."""
        for hf_name, tensor in weights:
            for old, new in self.renames:
                hf_name = hf_name.replace(old, new)
            if self._on_other_stage(hf_name):
                continue
            if m := _PER_EXPERT.match(hf_name):
                self._load_per_expert(hf_name, tensor, m, params, pending)
            elif m := _FUSED.match(hf_name):
                self._load_fused(hf_name, tensor, m, params, pending)
            elif m := _SHARED.match(hf_name):
                self._load_shared(hf_name, tensor, m, params, pending)
            else:
                yield hf_name, tensor

    def _param(self, name: str, hf_name: str, params) -> torch.Tensor:
        if name not in params:
            raise ValueError(f"unexpected weight {hf_name!r} for {type(self).__name__}")
        return params[name].data

    def _copy(self, hf_name: str, tensor, target: torch.Tensor, expected: tuple[int, ...],
              part: tuple[int, int, int] | None) -> None:
        if tensor_shape(tensor) != expected:
            raise ValueError(f"weight {hf_name!r} has shape {tensor_shape(tensor)}, expected {expected}")
        if part is None:
            value = read_slice(tensor)
        elif part[0] <= 1:
            value = read_slice(tensor, *part)
        else:  # a column slice of a stacked [E, H, I] tensor: read whole, then narrow
            value = read_slice(tensor).narrow(*part)
        with torch.no_grad():
            target.copy_(value)

    def _load_per_expert(self, hf_name, tensor, m, params, pending) -> None:
        expert, part = int(m["expert"]), _PART[m["proj"]]
        moe, r = self.dims.moe, self.layout.tp_rank
        inter, local = moe.intermediate_size, moe.intermediate_size // self.layout.tp_size
        if part == "down":
            name = f"{m['mlp']}.experts.w2"
            target = self._param(name, hf_name, params)[expert]
            self._copy(hf_name, tensor, target, (self.dims.hidden_size, inter), (1, r * local, local))
        else:
            name = f"{m['mlp']}.experts.w13"
            half = 0 if part == "gate" else 1
            target = self._param(name, hf_name, params)[expert, half * local:(half + 1) * local]
            self._copy(hf_name, tensor, target, (inter, self.dims.hidden_size), (0, r * local, local))
        pending.discard((name, f"{part}{expert}"))

    def _load_fused(self, hf_name, tensor, m, params, pending) -> None:
        moe, r = self.dims.moe, self.layout.tp_rank
        e, h, inter = moe.num_experts, self.dims.hidden_size, moe.intermediate_size
        local = inter // self.layout.tp_size
        if m["proj"] in ("down_proj", "w2"):
            name = f"{m['mlp']}.experts.w2"
            self._copy(hf_name, tensor, self._param(name, hf_name, params), (e, h, inter), (2, r * local, local))
            pending.difference_update((name, f"down{i}") for i in range(e))
            return
        name = f"{m['mlp']}.experts.w13"
        target = self._param(name, hf_name, params)
        for half, part in enumerate(("gate", "up")):
            self._copy(hf_name, tensor, target[:, half * local:(half + 1) * local], (e, 2 * inter, h),
                       (1, half * inter + r * local, local))
            pending.difference_update((name, f"{part}{i}") for i in range(e))

    def _load_shared(self, hf_name, tensor, m, params, pending) -> None:
        moe, r, h = self.dims.moe, self.layout.tp_rank, self.dims.hidden_size
        inter = moe.shared_intermediate_size
        local = inter // self.layout.tp_size
        proj = m["proj"]
        if proj in ("down_proj", "down"):
            name = f"{m['mlp']}.shared_expert.down.weight"
            self._copy(hf_name, tensor, self._param(name, hf_name, params), (h, inter), (1, r * local, local))
            pending.discard((name, "down"))
            return
        name = f"{m['mlp']}.shared_expert.gate_up.weight"
        target = self._param(name, hf_name, params)
        halves = [("gate", 0), ("up", 1)] if proj == "gate_up" else [(_PART[proj], 0 if proj == "gate_proj" else 1)]
        for part, half in halves:
            offset = half * inter if proj == "gate_up" else 0
            expected = (2 * inter, h) if proj == "gate_up" else (inter, h)
            self._copy(hf_name, tensor, target[half * local:(half + 1) * local], expected, (0, offset + r * local, local))
            pending.discard((name, part))
