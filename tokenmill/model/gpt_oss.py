"""gpt-oss (`GptOssForCausalLM`): GQA with q/k/v/o biases and attention sinks (a learned logit
per head in each softmax's denominator: `AttentionSpec.sinks`, every backend), sliding-window and
full layers alternating as `layer_types` says, YaRN rope; a sparse MoE in every layer whose router
has a bias (top-k of the logits, softmax over those k: renormalized softmax-then-top-k), whose
experts have biases and the clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 gate), gate and up
clamped at `swiglu_limit`).

Expert weights arrive as transformers holds them, `mlp.experts.gate_up_proj` [E, H, 2I] with gate
and up interleaved (gate in the even columns, up in the odd ones), `gate_up_proj_bias` [E, 2I] alike,
`down_proj` [E, I, H], `down_proj_bias` [E, H]; or as MXFP4 (`<name>_blocks` / `<name>_scales`,
`tokenmill.model.mxfp4`: [E, 2I, H / 32, 16] and [E, H, I / 32, 16], output rows first),
dequantized at load; or under our own names (dummy weights). They land de-interleaved in the
shared MoE layer's `w13` [E, 2 * I_local, H] ([gate | up] rows of this TP rank) and `w2`.
The router is `mlp.router` in HF (our `mlp.gate`). Sinks are split by query head under TP.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenmill.config import ModelArch
from tokenmill.distributed.parallel_state import ParallelContext
from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.rotary import RotaryStep
from tokenmill.model import mxfp4
from tokenmill.model.llama import LlamaAttention
from tokenmill.model.moe_decoder import MoECausalLM, MoEDecoderLayer, MoEModel
from tokenmill.model.weight_source import LazyTensor, read_slice

# transformers' expert tensors (dense or MXFP4 halves), and our own biases (dummy weights); our
# `experts.w13` / `experts.w2` go on to the shared MoE loader.
_EXPERTS = re.compile(r"^(?P<mlp>.*\.mlp)\.experts\.(?:(?P<proj>gate_up_proj|down_proj)(?P<kind>_bias|_blocks|_scales)?"
                      r"|(?P<ours>b13|b2))$")


class GptOssAttention(LlamaAttention):
    def __init__(self, dims: ModelArch, attn_backend_cls: type[AttentionBackend], parallel: ParallelContext,
                 layer: int = 0) -> None:
        super().__init__(dims, attn_backend_cls, parallel, layer)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)  # this rank's heads

    def forward(self, hidden: torch.Tensor, rope: RotaryStep, kv_cache: torch.Tensor, meta: AttentionMetadata,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        self.attn.sinks = self.sinks  # the parameter as loaded and placed (the backend never owns it)
        return super().forward(hidden, rope, kv_cache, meta, residual)


class GptOssDecoderLayer(MoEDecoderLayer):
    attention_cls = GptOssAttention


class GptOssModel(MoEModel):
    layer_cls = GptOssDecoderLayer


class GptOssForCausalLM(MoECausalLM):
    model_cls = GptOssModel
    renames = ((".mlp.router.", ".mlp.gate."),)

    def _parts_of(self, name: str, param: torch.Tensor) -> list[str]:
        if name.endswith(("experts.b13", "experts.b2")):
            return ["bias"]
        return super()._parts_of(name, param)

    def _take_experts(self, weights, params, pending) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
        return super()._take_experts(self._gpt_oss_experts(weights, params, pending), params, pending)

    def _gpt_oss_experts(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]], params,
                         pending) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
        """Loads the experts' tensors (an MXFP4 pair once both halves have come); yields the rest."""
        halves: dict[str, dict[str, torch.Tensor | LazyTensor]] = {}
        for hf_name, tensor in weights:
            m = _EXPERTS.match(hf_name)
            if m is None:
                yield hf_name, tensor
                continue
            if self._on_other_stage(hf_name):
                continue
            mlp, proj, kind = m["mlp"], m["proj"] or m["ours"], m["kind"]
            if kind in ("_blocks", "_scales"):
                pair = halves.setdefault(f"{mlp}.experts.{proj}", {})
                pair[kind] = tensor
                if len(pair) < 2:
                    continue
                del halves[f"{mlp}.experts.{proj}"]
                value = mxfp4.dequantize(read_slice(pair["_blocks"]), read_slice(pair["_scales"]))  # [E, out, in]
                if proj == "gate_up_proj":
                    self._load_gate_up(hf_name, value.transpose(1, 2), mlp, params, pending)
                else:
                    self._load_down(hf_name, value, mlp, params, pending)
            elif proj == "gate_up_proj" and kind is None:
                self._load_gate_up(hf_name, read_slice(tensor), mlp, params, pending)
            elif proj == "down_proj" and kind is None:
                self._load_down(hf_name, read_slice(tensor).transpose(1, 2), mlp, params, pending)
            elif proj in ("gate_up_proj", "b13"):
                bias = read_slice(tensor)
                if proj == "gate_up_proj":  # transformers interleaves gate and up
                    bias = torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1)
                self._load_b13(hf_name, bias, mlp, params, pending)
            else:
                self._load_b2(hf_name, read_slice(tensor), mlp, params, pending)
        if halves:
            raise ValueError(f"MXFP4 tensors without their other half (_blocks / _scales): "
                             f"{', '.join(sorted(halves))}")

    def _sizes(self) -> tuple[int, int, int, int, int]:
        moe = self.dims.moe
        local = moe.intermediate_size // self.layout.tp_size
        return moe.num_experts, self.dims.hidden_size, moe.intermediate_size, local, self.layout.tp_rank * local

    def _check(self, hf_name: str, value: torch.Tensor, expected: tuple[int, ...]) -> None:
        if tuple(value.shape) != expected:
            raise ValueError(f"weight {hf_name!r} has shape {tuple(value.shape)}, expected {expected}")

    def _load_gate_up(self, hf_name: str, full: torch.Tensor, mlp: str, params, pending) -> None:
        """full: [E, H, 2I], gate and up interleaved along the last axis."""
        e, h, inter, local, start = self._sizes()
        self._check(hf_name, full, (e, h, 2 * inter))
        name = f"{mlp}.experts.w13"
        target = self._param(name, hf_name, params)
        with torch.no_grad():
            for half in (0, 1):  # gate: even columns, up: odd
                part = full[:, :, half::2][:, :, start:start + local]
                target[:, half * local:(half + 1) * local].copy_(part.transpose(1, 2))
        pending.difference_update((name, f"{p}{i}") for i in range(e) for p in ("gate", "up"))

    def _load_down(self, hf_name: str, full: torch.Tensor, mlp: str, params, pending) -> None:
        """full: [E, H, I]."""
        e, h, inter, local, start = self._sizes()
        self._check(hf_name, full, (e, h, inter))
        name = f"{mlp}.experts.w2"
        with torch.no_grad():
            self._param(name, hf_name, params).copy_(full[:, :, start:start + local])
        pending.difference_update((name, f"down{i}") for i in range(e))

    def _load_b13(self, hf_name: str, bias: torch.Tensor, mlp: str, params, pending) -> None:
        """bias: [E, 2I] as [gate | up]."""
        e, _, inter, local, start = self._sizes()
        self._check(hf_name, bias, (e, 2 * inter))
        name = f"{mlp}.experts.b13"
        target = self._param(name, hf_name, params)
        with torch.no_grad():
            target[:, :local].copy_(bias[:, start:start + local])
            target[:, local:].copy_(bias[:, inter + start:inter + start + local])
        pending.discard((name, "bias"))

    def _load_b2(self, hf_name: str, bias: torch.Tensor, mlp: str, params, pending) -> None:
        """bias: [E, H]; held by TP rank 0 only (the ranks' outputs are summed)."""
        e, h, *_ = self._sizes()
        self._check(hf_name, bias, (e, h))
        name = f"{mlp}.experts.b2"
        with torch.no_grad():
            target = self._param(name, hf_name, params)
            target.copy_(bias) if self.layout.tp_rank == 0 else target.zero_()
        pending.discard((name, "bias"))

    def _source_slice(self, name: str, shard: int | None) -> tuple[int, int, int] | None:
        """Sinks are split like the query heads they belong to."""
        if self.layout.tp_size > 1 and name.endswith("self_attn.sinks"):
            heads = self.layout.num_heads
            return 0, self.layout.tp_rank * heads, heads
        return super()._source_slice(name, shard)

    def _checkpoint_shape(self, name: str, shard: int | None, local: tuple[int, ...]) -> tuple[int, ...]:
        if self.layout.tp_size > 1 and name.endswith("self_attn.sinks"):
            return (self.dims.num_heads,)
        return super()._checkpoint_shape(name, shard, local)
