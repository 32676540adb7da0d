"""The LoRA shrink in Triton: x[t] @ A[slot(t)]^T as float32 partial sums over K slices, per
token (rows) or over one slot's tiles (tiles); the launch shapes come from the plan (`triton_lora`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.lora import triton_lora as dispatch
from tokenmill.layers.lora.triton_lora import StepPlan


@triton.jit
def _shrink_rows_kernel(x_ptr, a_ptr, out_ptr, slots_ptr, N, K, K_PER_SPLIT,
                        stride_xt, stride_as, stride_an, stride_split, stride_ot,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (token, n, split): the token's x over the split's K range times its slot's A rows."""
    t, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s = tl.load(slots_ptr + t).to(tl.int64)
    if s < 0:
        return
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    a_rows = a_ptr + s * stride_as + n[:, None].to(tl.int64) * stride_an
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        av = tl.load(a_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(out_ptr + pid_k * stride_split + t * stride_ot + n, acc, mask=n_ok)



@triton.jit(do_not_specialize=["MAX_TILES", "GRID_M"])
def _shrink_tiles_kernel(x_ptr, a_ptr, out_ptr, order_ptr, tiles_ptr, count_ptr, MAX_TILES, GRID_M, N, K,
                         K_PER_SPLIT, stride_xt, stride_as, stride_an, stride_split, stride_ot,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr):
    """Program (i, n, split): tiles i, i + GRID_M, ... of the step (each of one slot), over the
    split's K range, a dot each."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k_start = pid_k * K_PER_SPLIT
    for i in range(pid_m, tl.load(count_ptr), GRID_M):
        s = tl.load(tiles_ptr + i).to(tl.int64)
        if s >= 0:  # (-1: tokens without an adapter)
            row0 = tl.load(tiles_ptr + MAX_TILES + i)
            row1 = tl.load(tiles_ptr + 2 * MAX_TILES + i)
            m = row0 + tl.arange(0, BLOCK_M)
            m_ok = m < row1
            rows = tl.load(order_ptr + m, mask=m_ok, other=0).to(tl.int64)
            a_base = a_ptr + s * stride_as + n[None, :].to(tl.int64) * stride_an
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < K
                xb = tl.load(x_ptr + rows[:, None] * stride_xt + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                             other=0.0)
                ab = tl.load(a_base + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                if IEEE:  # float32 inputs: exact float32 products, not TF32
                    acc += tl.dot(xb, ab, input_precision="ieee")
                else:
                    acc += tl.dot(xb, ab)
            tl.store(out_ptr + pid_k * stride_split + rows[:, None] * stride_ot + n[None, :], acc,
                     mask=m_ok[:, None] & n_ok[None, :])



def lora_shrink(x: torch.Tensor, a: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """x[t] @ A[slot(t)]^T as float32 partial sums [splits, T, parts * R] (a view of the plan's
    workspace; rows of tokens without an adapter are left unwritten)."""
    num_tokens, k = x.shape
    n = a.shape[1]
    cfg = dispatch.shrink_config(num_tokens, n, k, plan.num_slots, dispatch._sm_count(x.device),
                                 plan.order is None)
    planes = plan.workspace[:cfg.planes_numel(num_tokens, n)].view(cfg.splits, num_tokens, n)
    assert x.stride(1) == 1 and a.stride(2) == 1
    if cfg.rows:
        _shrink_rows_kernel[cfg.grid](x, a, planes, plan.token_slots, n, k, cfg.k_per_split,
                                      x.stride(0), a.stride(0), a.stride(1), planes.stride(0), planes.stride(1),
                                      BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    else:
        grid = (plan.grid_m,) + cfg.grid[1:]
        _shrink_tiles_kernel[grid](x, a, planes, plan.order, plan.tiles, plan.count, plan.tiles.shape[1],
                                       plan.grid_m, n, k, cfg.k_per_split, x.stride(0), a.stride(0), a.stride(1),
                                       planes.stride(0), planes.stride(1), BLOCK_M=cfg.block_m,
                                       BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=x.dtype == torch.float32)
    return planes
