"""Triton kernel: FP8 W8A8 GEMM with row-wise scales in the epilogue, for batches where the
tensor cores bound the time (prefill, 64+ rows): out = (xq @ wq^T) * x_scale[:, None] * w_scale[None, :].

xq [M, K] e4m3 with one float32 scale per row (per token), wq [N, K] e4m3 with one per output
channel; float32 accumulation (`tl.dot` on fp8 operands: Hopper's fp8 tensor cores), the two
scales applied once to the finished tile, written in the output dtype. An alternative to
`torch._scaled_mm`'s row-wise kernel where the sweep (`scripts/gpu_quant.py --parts sweep`) says
it is faster. K must be a multiple of BLOCK_K (the loop is unmasked along K).

Split-K (`split` > 1, with a layer's zeroed counters): few row tiles times N tiles cannot fill the
SMs (256 rows of o_proj / down_proj are 2 x 32 tiles of 128 x 128 on 132 SMs), so K is cut into
slices, each program scales its partial tile and the last one of a tile sums them
(`triton_split_k.store_tile`: one launch, deterministic order, counters reset for graph replays).

Torch reference: `fp8_ops.scaled_mm_reference`. Under TRITON_INTERPRET=1 the fp8 operands may be
float32 tensors holding fp8 values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.quantization.triton_split_k import store_tile


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, part_ptr, cnt_ptr, M, N, K, s_am, s_bn, s_cm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, SPLIT_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    split = tl.num_programs(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # groups of GROUP_M row tiles walk the columns together: their weight tiles stay in L2
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_steps = tl.cdiv(tl.cdiv(K, BLOCK_K), split)  # this program's K slice, in BLOCK_K steps
    k_lo = pid_k * k_steps * BLOCK_K
    k_hi = tl.minimum(k_lo + k_steps * BLOCK_K, K)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * s_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[:, None].to(tl.int64) * s_bn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(k_lo, k_hi, BLOCK_K):
        a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_mask[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    sa = tl.load(as_ptr + offs_m, mask=m_mask, other=0.0)
    sb = tl.load(bs_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * sa[:, None] * sb[None, :]
    store_tile(acc, c_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, s_cm, pid, pid_k, split, SPLIT_K)


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, block_m: int = 128, block_n: int = 128, block_k: int = 128, group_m: int = 8,
             warps: int = 8, stages: int = 4, split: int = 1, counters: torch.Tensor | None = None) -> torch.Tensor:
    """xq [M, K] fp8 (x_scale [M, 1] or [M]) @ wq [N, K]^T fp8 (w_scale [N, 1] or [N]) -> [M, N].
    split > 1 cuts K into that many slices; it needs `counters` (zeroed int32, one per output
    tile: `stream_tiles.SplitCounters`), else (or where they are too few) the GEMM runs unsplit."""
    m, k = xq.shape
    n = wq.shape[0]
    if k % block_k:
        raise ValueError(f"fp8 GEMM: K {k} must be a multiple of BLOCK_K {block_k}")
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = max(1, min(split, k // block_k))
    if counters is None or tiles > counters.numel():
        split = 1
    part = torch.empty((split, m, n), dtype=torch.float32, device=xq.device) if split > 1 else out
    _fp8_gemm_kernel[(tiles, split)](xq, x_scale.reshape(-1), wq, w_scale.reshape(-1), out, part,
                                     counters if split > 1 else out, m, n, k,
                                     xq.stride(0), wq.stride(0), out.stride(0),
                                     BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                                     DOT_PRECISION="ieee" if xq.dtype == torch.float32 else "tf32",
                                     SPLIT_K=split > 1, num_warps=warps, num_stages=stages)
    return out
