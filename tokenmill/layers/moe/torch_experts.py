"""The experts in torch (CPU, and the reference the fused kernel is tested against).

The token-expert pairs are sorted by expert, so each expert that received tokens runs one
gate/up and one down matmul over its rows and experts without tokens cost nothing: the work is
T * k rows, never T * E. Each row's output is scaled by its routing weight and summed back into
its token with one `index_add_` (pairs in expert order, as HF's loop adds them).

gpt-oss: optional biases (`b13` [E, 2I] on gate/up, `b2` [E, H] on down) and its clamped SwiGLU
(`Activation("swiglu_clamped", alpha, limit)`), computed in float32 and rounded once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class Activation(NamedTuple):
    """The experts' gated activation: "silu" (silu(gate) * up) or "swiglu_clamped" (gpt-oss:
    gate <= limit, -limit <= up <= limit, (up + 1) * gate * sigmoid(alpha * gate))."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0


SILU = Activation()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gated_activation(x: torch.Tensor, act: Activation = SILU) -> torch.Tensor:
    """x [..., 2I] ([gate | up]) -> [..., I]."""
    if act.kind == "silu":
        return silu_and_mul(x)
    gate, up = x.float().chunk(2, dim=-1)
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return ((up + 1) * (gate * torch.sigmoid(gate * act.alpha))).to(x.dtype)


def experts_forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                    act: Activation = SILU) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] ([gate | up] rows); w2 [E, H, I]; weights float32 [T, k];
    ids int64 [T, k] -> [T, H] in x's dtype: sum over k of weight * down(act(gate, up)) (biases
    b13 [E, 2I] / b2 [E, H] added to the projections where given)."""
    num_tokens, top_k = ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # host values: this path syncs
    token_of = order // top_k
    rows = x.index_select(0, token_of)
    row_weights = weights.reshape(-1).index_select(0, order)
    result = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        part = slice(start, start + count)
        hidden = gated_activation(F.linear(rows[part], w13[expert], None if b13 is None else b13[expert]), act)
        result[part] = F.linear(hidden, w2[expert], None if b2 is None else b2[expert])
        start += count
    # The top-k weighted outputs summed in float32 and rounded once (as the fused Triton path
    # does), not rounded after each expert's add into a bf16 output.
    summed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return summed.index_add_(0, token_of, result.float() * row_weights[:, None]).to(x.dtype)


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                      act: Activation = SILU) -> torch.Tensor:
    """The plain per-expert loop over every expert (tests and benchmarks: the thing to beat)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        token, slot = torch.where(ids == expert)
        if token.numel() == 0:
            continue
        hidden = gated_activation(F.linear(x[token], w13[expert], None if b13 is None else b13[expert]), act)
        down = F.linear(hidden, w2[expert], None if b2 is None else b2[expert])
        out.index_add_(0, token, down.float() * weights[token, slot, None])
    return out.to(x.dtype)
