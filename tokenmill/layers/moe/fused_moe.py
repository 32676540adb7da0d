"""The fused MoE on CUDA: two grouped GEMM launches over every expert, plus one reduction.

1. `align_by_expert` sorts the token-expert pairs by expert and pads each expert's rows to
   BLOCK_M (on the device, capture-safe).
2. `_gate_up_kernel`: each program takes BLOCK_M sorted rows (one expert) and BLOCK_N columns
   of the intermediate size; it gathers the rows' tokens from x, multiplies by that expert's
   gate and up tiles of w13 [E, 2I, H], and writes silu(gate) * up to the padded intermediate
   buffer [rows, I] (the activation fused: no [rows, 2I] tensor).
3. `_down_kernel`: the same blocks times w2 [E, H, I], each row scaled by its routing weight,
   written to the pair's row of [T * k, H].
4. The top-k rows of each token are summed (one torch reduction).
At decode sizes the alignment is one Triton launch too (`triton_align`), so a layer's experts
take four launches whatever the batch.
gpt-oss: with HAS_BIAS the experts' biases join the accumulators (b13 [E, 2I] before the
activation, b2 [E, H] before the routing weight); ACT 1 is its clamped SwiGLU, in float32.
Blocks past the last expert's rows exit at once (their expert reads E). fp32 dots use exact
("ieee") precision so float32 matches the torch path; half types accumulate in float32.

Tile sizes come from `tile_configs` (tuned per (E, H, I, batch bucket), JSON in the repository).
Requires triton at import; `layer.py` imports this module only when `triton_ops.enabled`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.moe.align import align_by_expert
from tokenmill.layers.moe.tile_configs import TileConfig, tile_config
from tokenmill.layers.moe.torch_experts import SILU, Activation


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, bias_ptr,
                    alpha, limit,
                    s_xt, s_we, s_wn, s_wk, s_ot,
                    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    block = tl.program_id(0)
    col_block = tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_EXPERTS:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_valid = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < INTER
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * s_we
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k = k0 + offs_k
        k_valid = k < HIDDEN
        a = tl.load(x_ptr + tokens[:, None] * s_xt + k[None, :], mask=row_valid[:, None] & k_valid[None, :],
                    other=0.0)
        wg = tl.load(w_base + cols[None, :] * s_wn + k[:, None] * s_wk, mask=col_valid[None, :] & k_valid[:, None],
                     other=0.0)
        wu = tl.load(w_base + (cols[None, :] + INTER) * s_wn + k[:, None] * s_wk,
                     mask=col_valid[None, :] & k_valid[:, None], other=0.0)
        gate = tl.dot(a, wg, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, wu, up, input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:  # F.linear's bias: added to the float32 accumulator, then rounded with it
        b_base = bias_ptr + expert.to(tl.int64) * (2 * INTER)
        gate += tl.load(b_base + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_base + INTER + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    if ACT == 1:  # gpt-oss's clamped SwiGLU, in float32 from the rounded projections, rounded once
        g = tl.minimum(gate.to(dtype).to(tl.float32), limit)
        u = tl.minimum(tl.maximum(up.to(dtype).to(tl.float32), -limit), limit)
        act = ((u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))).to(dtype)
    else:
        # As the torch path rounds: silu in float32 to the activation dtype, then the product.
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        act = (silu * up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * s_ot + cols[None, :], act, mask=col_valid[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(a_ptr, w_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, bias_ptr,
                 s_at, s_we, s_wn, s_wk, s_ot,
                 HIDDEN: tl.constexpr, INTER: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr):
    block = tl.program_id(0)
    col_block = tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_EXPERTS:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_valid = pairs < num_pairs
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * s_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k = k0 + offs_k
        k_valid = k < INTER
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * s_at + k[None, :], mask=row_valid[:, None] & k_valid[None, :],
                    other=0.0)
        w = tl.load(w_base + cols[None, :] * s_wn + k[:, None] * s_wk, mask=col_valid[None, :] & k_valid[:, None],
                    other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * HIDDEN + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(weights_ptr + pairs, mask=row_valid, other=0.0)
    # The matmul rounds to the activation dtype first, as F.linear does, then the weight scales it.
    out = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    dst = out_ptr + pairs.to(tl.int64)[:, None] * s_ot + cols[None, :]
    tl.store(dst, out, mask=row_valid[:, None] & col_valid[None, :])


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  config: TileConfig | None = None, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  act: Activation = SILU) -> torch.Tensor:
    """`torch_experts.experts_forward`'s result, in two grouped GEMM launches (see the module doc)."""
    if act.kind not in ("silu", "swiglu_clamped"):
        raise ValueError(f"expert activation {act.kind!r} is not supported (silu, swiglu_clamped)")
    if (b13 is None) != (b2 is None):
        raise ValueError("the experts' biases come in pairs: b13 and b2, or neither")
    num_tokens, top_k = ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if num_tokens == 0:
        return torch.zeros_like(x)
    cfg = config or tile_config(num_experts, hidden, inter, num_tokens, str(x.dtype).removeprefix("torch."), top_k)
    x = x.contiguous()
    align = align_by_expert(ids, num_experts, cfg.block_m)
    num_pairs = num_tokens * top_k
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act_out = torch.empty((align.max_blocks * cfg.block_m, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(align.max_blocks, triton.cdiv(inter, cfg.block_n))](
        x, w13, act_out, align.sorted_pairs, align.block_expert, num_pairs,
        w13 if b13 is None else b13.contiguous(), float(act.alpha), float(act.limit),
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act_out.stride(0),
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, NUM_EXPERTS=num_experts,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION=precision,
        HAS_BIAS=b13 is not None, ACT=int(act.kind == "swiglu_clamped"),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).float().contiguous()
    _down_kernel[(align.max_blocks, triton.cdiv(hidden, cfg.down_block_n))](
        act_out, w2, per_pair, flat_weights, align.sorted_pairs, align.block_expert, num_pairs,
        w2 if b2 is None else b2.contiguous(),
        act_out.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), per_pair.stride(0),
        HIDDEN=hidden, INTER=inter, NUM_EXPERTS=num_experts,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k, DOT_PRECISION=precision,
        HAS_BIAS=b2 is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if top_k == 1:
        return per_pair
    # One kernel: half types accumulate in float32 and round once, as sum(dtype=float32).to(dtype) would.
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)
