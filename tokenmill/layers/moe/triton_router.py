"""The router in two Triton launches (CUDA): logits, then scores, top-k, renormalization and scaling.

`routing.select_experts` over `Router`'s float32 logits takes about ten small torch kernels (two
casts, the matmul, softmax, top-k, gather, the renormalization); at decode sizes each costs more
than its work. Two launches here: `_logits_kernel` computes x @ W^T with float32 accumulation over
(16 tokens, 16 experts, a slice of the hidden size) tiles, so that at batch 1 dozens of programs
stream the router weight instead of one (half-type products are exact in float32, so this is the
float32 matmul of the torch path up to summation order; float32 inputs use exact "ieee" dots);
`_select_kernel` sums the slices' partial logits in order, adds the router bias, takes softmax or
sigmoid in float32, then k rounds of "take the best, mask it" (ties: the lowest expert id), the
chosen scores renormalized to sum to 1 where asked and times routed_scaling_factor.
Weights come out float32 [T, k], ids int64 [T, k], best first (the torch path's order is
unspecified; nothing downstream depends on it).

Covers the routers without expert groups or a correction bias (Mixtral, Qwen2/3-MoE, OLMoE,
gpt-oss); DeepSeek's grouped, bias-corrected choice stays on the torch path
(`routing.fused_router_applies`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.config import MoEArch
from tokenmill.layers.moe.routing import fused_router_applies

BLOCK_T = 16  # tokens per program (tl.dot needs 16 rows)
BLOCK_E = 16  # experts per logits program
BLOCK_H = 64
MAX_SPLITS = 8


@triton.jit(do_not_specialize=["num_tokens"])
def _logits_kernel(x_ptr, w_ptr, part_ptr, num_tokens, s_xt, h_per_split,
                   HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """part[split, token, expert] = x[token, h range of split] . w[expert, h range of split]."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_valid = tokens < num_tokens
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_valid = experts < NUM_EXPERTS
    split = tl.program_id(2)
    h_lo = split * h_per_split
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for h0 in range(h_lo, h_lo + h_per_split, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_valid = h < HIDDEN
        a = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * s_xt + h[None, :], mask=t_valid[:, None] & h_valid[None, :],
                    other=0.0)
        w = tl.load(w_ptr + experts[None, :] * HIDDEN + h[:, None], mask=e_valid[None, :] & h_valid[:, None],
                    other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    dst = part_ptr + (split * num_tokens + tokens.to(tl.int64))[:, None] * E_PAD + experts[None, :]
    tl.store(dst, acc, mask=t_valid[:, None] & e_valid[None, :])


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _select_kernel(part_ptr, b_ptr, weights_ptr, ids_ptr, num_tokens, num_splits, scale,
                   NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                   BLOCK_T: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The splits' partial logits summed (in split order), then scores, top-k and the weights."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_valid = tokens < num_tokens
    experts = tl.arange(0, E_PAD)
    e_valid = experts < NUM_EXPERTS
    mask = t_valid[:, None] & e_valid[None, :]
    logits = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
    for split in range(0, num_splits):
        src = part_ptr + (split * num_tokens + tokens.to(tl.int64))[:, None] * E_PAD + experts[None, :]
        logits += tl.load(src, mask=mask, other=0.0)
    if HAS_BIAS:
        logits += tl.load(b_ptr + experts, mask=e_valid, other=0.0).to(tl.float32)[None, :]
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        shifted = tl.where(e_valid[None, :], logits, float("-inf"))
        p = tl.exp(shifted - tl.max(shifted, axis=1)[:, None])
        scores = p / tl.sum(p, axis=1)[:, None]
    choice = tl.where(e_valid[None, :], scores, -1.0)  # scores are >= 0: padding is never chosen
    slots = tl.arange(0, K_PAD)
    chosen_w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    chosen_id = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)
        best_id = tl.min(tl.where(choice == best[:, None], experts[None, :], E_PAD), axis=1)
        chosen_w = tl.where(slots[None, :] == j, best[:, None], chosen_w)
        chosen_id = tl.where(slots[None, :] == j, best_id[:, None], chosen_id)
        choice = tl.where(experts[None, :] == best_id[:, None], -2.0, choice)
    if RENORMALIZE:
        chosen_w = chosen_w / (tl.sum(chosen_w, axis=1)[:, None] + 1e-20)
    chosen_w = chosen_w * scale
    out = tokens.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    out_mask = t_valid[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, chosen_w, mask=out_mask)
    tl.store(ids_ptr + out, chosen_id.to(tl.int64), mask=out_mask)


def num_hidden_splits(num_tokens: int, num_experts: int) -> int:
    """Split the hidden axis until about 256 programs stream the router weight (a lone program per
    16 tokens reads all of it at one SM's pace: 18 us a layer at batch 1 on an H200)."""
    programs = triton.cdiv(num_tokens, BLOCK_T) * triton.cdiv(num_experts, BLOCK_E)
    return max(1, min(MAX_SPLITS, 256 // programs))


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          moe: MoEArch) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], weight [E, H] (x's dtype) -> (weights float32 [T, k], ids int64 [T, k])."""
    if not fused_router_applies(moe):
        raise ValueError("the fused router covers softmax/sigmoid routing without groups or a correction bias")
    num_tokens, hidden = x.shape
    num_experts, k = moe.num_experts, moe.top_k
    weights = torch.empty((num_tokens, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((num_tokens, k), dtype=torch.int64, device=x.device)
    if num_tokens == 0:
        return weights, ids
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.to(x.dtype).contiguous()
    splits = num_hidden_splits(num_tokens, num_experts)
    h_per_split = triton.cdiv(triton.cdiv(hidden, splits), BLOCK_H) * BLOCK_H
    splits = triton.cdiv(hidden, h_per_split)
    e_pad = max(16, triton.next_power_of_2(num_experts))
    part = torch.empty((splits, num_tokens, e_pad), dtype=torch.float32, device=x.device)
    _logits_kernel[(triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(num_experts, BLOCK_E), splits)](
        x, weight, part, num_tokens, x.stride(0), h_per_split,
        HIDDEN=hidden, NUM_EXPERTS=num_experts, E_PAD=e_pad, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_H=BLOCK_H,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4)
    _select_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        part, part if bias is None else bias.contiguous(), weights, ids, num_tokens, splits,
        float(moe.routed_scaling_factor),
        NUM_EXPERTS=num_experts, E_PAD=e_pad, TOP_K=k, K_PAD=max(2, triton.next_power_of_2(k)), BLOCK_T=BLOCK_T,
        SIGMOID=moe.scoring == "sigmoid", RENORMALIZE=moe.renormalize, HAS_BIAS=bias is not None, num_warps=4)
    return weights, ids
