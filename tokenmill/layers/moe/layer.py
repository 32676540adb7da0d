"""The MoE MLP the families share: router -> top-k -> experts -> weighted sum (+ shared expert).

Under tensor parallelism each rank holds a slice of every expert's intermediate size (and of the
shared expert's): its routed and shared outputs are partial sums, added together and all-reduced
once. The router (and the shared expert's gate) is replicated: every rank routes alike.

Parameters: `gate.weight` [E, H] (+ `gate.e_score_correction_bias` [E], DeepSeek-V3),
`experts.w13` [E, 2 * I_local, H] ([gate | up] rows of each expert), `experts.w2` [E, H, I_local],
`shared_expert.gate_up.weight` / `shared_expert.down.weight`, `shared_expert_gate.weight` [1, H].
gpt-oss adds `gate.bias` [E] and the experts' `b13` [E, 2 * I_local] / `b2` [E, H] (b2 is held by
TP rank 0 only, zeros elsewhere, so the all-reduce adds it once).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import MoEArch
from tokenmill.distributed.parallel_state import ParallelContext
from tokenmill.layers import triton_ops
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.linear import Linear
from tokenmill.layers.moe import routing
from tokenmill.layers.moe.torch_experts import Activation, experts_forward


class Router(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEArch) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.empty(moe.num_experts), requires_grad=False)
                                        if moe.score_correction_bias else None)
        self.bias = nn.Parameter(torch.empty(moe.num_experts), requires_grad=False) if moe.router_bias else None
        self.moe = moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], expert ids [T, k]); logits in float32 (DeepSeek's rule; exact
        for float32 models). On CUDA two Triton launches do it where they cover the rule."""
        if triton_ops.enabled(x) and routing.fused_router_applies(self.moe):
            from tokenmill.layers.moe.triton_router import route
            return route(x, self.weight, self.bias, self.moe)
        logits = torch.nn.functional.linear(x.float(), self.weight.float(),
                                            None if self.bias is None else self.bias.float())
        return routing.select_experts(logits, self.moe, self.e_score_correction_bias)


class Experts(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEArch, local_inter: int) -> None:
        super().__init__()
        e = moe.num_experts
        self.w13 = nn.Parameter(torch.empty(e, 2 * local_inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, local_inter), requires_grad=False)
        self.b13 = self.b2 = None
        if moe.expert_bias:
            self.b13 = nn.Parameter(torch.empty(e, 2 * local_inter), requires_grad=False)
            self.b2 = nn.Parameter(torch.empty(e, hidden_size), requires_grad=False)
        self.act = Activation(moe.activation, moe.swiglu_alpha, moe.swiglu_limit)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if triton_ops.enabled(x):
            from tokenmill.layers.moe.fused_moe import fused_experts
            return fused_experts(x, self.w13, self.w2, weights, ids, b13=self.b13, b2=self.b2, act=self.act)
        return experts_forward(x, self.w13, self.w2, weights, ids, self.b13, self.b2, self.act)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP over this rank's slice of its intermediate size (no all-reduce here)."""

    def __init__(self, hidden_size: int, local_inter: int) -> None:
        super().__init__()
        self.gate_up = Linear(hidden_size, 2 * local_inter, bias=False)
        self.down = Linear(local_inter, hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate_up(x)))


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEArch, parallel: ParallelContext) -> None:
        super().__init__()
        tp = parallel.tp_size
        self.gate = Router(hidden_size, moe)
        self.experts = Experts(hidden_size, moe, moe.intermediate_size // tp)
        self.shared_expert = (SharedExpert(hidden_size, moe.shared_intermediate_size // tp)
                              if moe.shared_intermediate_size else None)
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if moe.shared_expert_gate else None
        self.parallel = parallel

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MoE output summed over the TP group, plus `residual` when given."""
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        out = self.parallel.all_reduce(out)
        return out if residual is None else out + residual
