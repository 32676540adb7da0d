"""The decode path's fusions in Triton: gate_up's expand with SiLU-and-mul (y read once, the
activation written; per token it may also do down_proj's shrink of that activation), and the
activation of y plus a delta computed beside the GEMM (`silu_mul_add`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.lora import triton_lora as dispatch
from tokenmill.layers.lora.triton_lora import StepPlan


@triton.jit(do_not_specialize=["SPLITS"])
def _expand_silu_rows_kernel(t_ptr, b_ptr, y_ptr, out_ptr, slots_ptr, I, SPLITS,
                             stride_split, stride_tt, stride_bs, stride_bn, stride_yt, stride_ot,
                             a2_ptr, t2_ptr, N2, stride_a2s, stride_a2n, stride_t2split, stride_t2t,
                             RANK: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS_PAD: tl.constexpr,
                             NEXT: tl.constexpr, BLOCK_N2: tl.constexpr):
    """Program (token, n): silu(gate + delta) * (up + delta) for columns n of the token, from the
    base [gate | up] output y (every token: those without an adapter get no delta). NEXT: also
    the next projection's shrink over these columns (its input is this output: down_proj's A
    [slots, N2, I]), as plane `n` of its float32 partial sums [I / BLOCK_N, T, N2]."""
    dtype = y_ptr.dtype.element_ty
    t, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    s = tl.load(slots_ptr + t).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    gate = tl.load(y_ptr + t * stride_yt + n, mask=n_ok, other=0.0).to(tl.float32)
    up = tl.load(y_ptr + t * stride_yt + I + n, mask=n_ok, other=0.0).to(tl.float32)
    if s >= 0:
        r = tl.arange(0, RANK)
        sp = tl.arange(0, SPLITS_PAD)
        planes = t_ptr + sp[:, None] * stride_split + t * stride_tt + r[None, :]
        sp_ok = (sp < SPLITS)[:, None]
        s_gate = tl.sum(tl.load(planes, mask=sp_ok, other=0.0), axis=0)
        s_up = tl.sum(tl.load(planes + RANK, mask=sp_ok, other=0.0), axis=0)
        b_rows = b_ptr + s * stride_bs + n[:, None].to(tl.int64) * stride_bn + r[None, :]
        b_gate = tl.load(b_rows, mask=n_ok[:, None], other=0.0).to(tl.float32)
        b_up = tl.load(b_rows + I * stride_bn, mask=n_ok[:, None], other=0.0).to(tl.float32)
        # y + delta rounded as the unfused path stores it, then the activation's own roundings.
        gate = (gate + tl.sum(b_gate * s_gate[None, :], axis=1)).to(dtype).to(tl.float32)
        up = (up + tl.sum(b_up * s_up[None, :], axis=1)).to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    res = (silu * up).to(dtype)
    tl.store(out_ptr + t * stride_ot + n, res, mask=n_ok)
    if NEXT:
        if s >= 0:
            n2 = tl.arange(0, BLOCK_N2)
            a2 = tl.load(a2_ptr + s * stride_a2s + n2[:, None].to(tl.int64) * stride_a2n + n[None, :],
                         mask=(n2 < N2)[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
            part = tl.sum(a2 * res.to(tl.float32)[None, :], axis=1)
            tl.store(t2_ptr + pid_n * stride_t2split + t * stride_t2t + n2, part, mask=n2 < N2)


@triton.jit(do_not_specialize=["MAX_TILES", "GRID_M", "SPLITS"])
def _expand_silu_tiles_kernel(t_ptr, b_ptr, y_ptr, out_ptr, order_ptr, tiles_ptr, count_ptr, MAX_TILES, GRID_M, I,
                              SPLITS, stride_split, stride_tt, stride_bs, stride_bn, stride_yt, stride_ot,
                              RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              IEEE: tl.constexpr, UNROLL: tl.constexpr, SPLITS_MAX: tl.constexpr):
    """Program (i, n): for tiles i, i + GRID_M, ...: the activation of the tile's rows, columns n;
    tiles of tokens without an adapter (slot -1) get no delta."""
    dtype = y_ptr.dtype.element_ty
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    r = tl.arange(0, RANK)
    for i in range(pid_m, tl.load(count_ptr), GRID_M):
        s = tl.load(tiles_ptr + i).to(tl.int64)
        row0 = tl.load(tiles_ptr + MAX_TILES + i)
        row1 = tl.load(tiles_ptr + 2 * MAX_TILES + i)
        m = row0 + tl.arange(0, BLOCK_M)
        m_ok = m < row1
        rows = tl.load(order_ptr + m, mask=m_ok, other=0).to(tl.int64)
        ok = m_ok[:, None] & n_ok[None, :]
        y_ptrs = y_ptr + rows[:, None] * stride_yt + n[None, :]
        gate = tl.load(y_ptrs, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(y_ptrs + I, mask=ok, other=0.0).to(tl.float32)
        if s >= 0:
            t_ptrs = t_ptr + rows[:, None] * stride_tt + r[None, :]
            s_gate = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
            s_up = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
            if UNROLL:
                for split in tl.static_range(SPLITS_MAX):
                    live = m_ok[:, None] & (tl.full((BLOCK_M, 1), split, tl.int32) < SPLITS)
                    s_gate += tl.load(t_ptrs + split * stride_split, mask=live, other=0.0)
                    s_up += tl.load(t_ptrs + split * stride_split + RANK, mask=live, other=0.0)
            else:
                for split in range(0, SPLITS):
                    s_gate += tl.load(t_ptrs + split * stride_split, mask=m_ok[:, None], other=0.0)
                    s_up += tl.load(t_ptrs + split * stride_split + RANK, mask=m_ok[:, None], other=0.0)
            b_cols = b_ptr + s * stride_bs + n[None, :].to(tl.int64) * stride_bn + r[:, None]
            b_gate = tl.load(b_cols, mask=n_ok[None, :], other=0.0)
            b_up = tl.load(b_cols + I * stride_bn, mask=n_ok[None, :], other=0.0)
            if IEEE:
                gate = (gate + tl.dot(s_gate, b_gate, input_precision="ieee")).to(dtype).to(tl.float32)
                up = (up + tl.dot(s_up, b_up, input_precision="ieee")).to(dtype).to(tl.float32)
            else:
                gate = (gate + tl.dot(s_gate.to(dtype), b_gate)).to(dtype).to(tl.float32)
                up = (up + tl.dot(s_up.to(dtype), b_up)).to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * stride_ot + n[None, :], (silu * up).to(dtype), mask=ok)


@triton.jit
def _silu_mul_add_kernel(y_ptr, d_ptr, out_ptr, I, stride_yt, stride_dt, stride_ot, BLOCK: tl.constexpr):
    """Program (token, n): silu(gate + its delta) * (up + its delta), the sums rounded to y's dtype
    (as y + delta is stored) and the activation's own roundings (`SiluAndMul`)."""
    dtype = y_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < I
    y_row, d_row = y_ptr + t * stride_yt, d_ptr + t * stride_dt
    gate = tl.load(y_row + n, mask=ok, other=0.0).to(tl.float32) + tl.load(d_row + n, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(y_row + I + n, mask=ok, other=0.0).to(tl.float32) + tl.load(d_row + I + n, mask=ok, other=0.0).to(tl.float32)
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + n, (silu * up).to(dtype), mask=ok)


def silu_mul_add(y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of y + delta ([T, 2I] each, [gate | up]) in one pass: a new [T, I] tensor."""
    num_tokens, inter = y.shape[0], y.shape[1] // 2
    assert y.shape == delta.shape and y.stride(1) == 1 and delta.stride(1) == 1
    out = torch.empty(num_tokens, inter, dtype=y.dtype, device=y.device)
    block = min(triton.next_power_of_2(inter), 1024)
    if num_tokens:
        _silu_mul_add_kernel[(num_tokens, triton.cdiv(inter, block))](y, delta, out, inter, y.stride(0), delta.stride(0),
                                                                      out.stride(0), BLOCK=block, num_warps=4)
    return out


def _silu_rows_block_n(inter: int) -> int:
    return min(256, triton.next_power_of_2(inter))


def can_fuse_next_shrink(plan: StepPlan, inter: int, next_a: torch.Tensor) -> bool:
    """Whether `lora_expand_silu` can also do the next projection's shrink (A [slots, N2, inter]):
    per-token kernels only, and no more planes than the rows expand sums."""
    return (plan.order is None and next_a.shape[2] == inter and next_a.stride(2) == 1
            and triton.cdiv(inter, _silu_rows_block_n(inter)) <= dispatch._ROWS_MAX_SPLITS and next_a.shape[1] <= 64)


def lora_expand_silu(planes: torch.Tensor, b: torch.Tensor, plan: StepPlan, y: torch.Tensor,
                     next_a: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up of the [gate | up] projection's output `y` plus its LoRA deltas, in one pass
    (instead of the expand adding into y and the activation reading it back): a new [T, I] tensor
    with `SiluAndMul`'s roundings. `b`: [slots, 2 * I, R]; `planes`: the shrink's [splits, T, 2R].
    `next_a` (per-token kernels, `can_fuse_next_shrink`): the next projection's A, whose shrink of
    the output the same kernel computes: returns (output, that shrink's planes) (a view of the
    plan's `next_workspace`)."""
    splits, num_tokens, _ = planes.shape
    inter, rank = b.shape[1] // 2, b.shape[2]
    assert y.stride(1) == 1 and b.stride(2) == 1 and y.shape[1] == 2 * inter
    out = torch.empty(num_tokens, inter, dtype=y.dtype, device=y.device)
    if plan.order is None:
        block_n = _silu_rows_block_n(inter)
        grid = (num_tokens, triton.cdiv(inter, block_n))
        if next_a is not None:
            assert can_fuse_next_shrink(plan, inter, next_a)
            n2 = next_a.shape[1]
            next_planes = plan.next_workspace[:grid[1] * num_tokens * n2].view(grid[1], num_tokens, n2)
            fused = (next_a, next_planes, n2, next_a.stride(0), next_a.stride(1), next_planes.stride(0),
                     next_planes.stride(1))
        else:
            fused = (y, y, 0, 0, 0, 0, 0)  # (unused)
        _expand_silu_rows_kernel[grid](
            planes, b, y, out, plan.token_slots, inter, splits, planes.stride(0), planes.stride(1),
            b.stride(0), b.stride(1), y.stride(0), out.stride(0), *fused, RANK=rank, BLOCK_N=block_n,
            SPLITS_PAD=dispatch._ROWS_MAX_SPLITS, NEXT=next_a is not None,
            BLOCK_N2=triton.next_power_of_2(max(fused[2], 16)))
        return out if next_a is None else (out, next_planes)
    else:
        block_n = min(dispatch.SILU_TILE_BLOCK_N, triton.next_power_of_2(inter))
        _expand_silu_tiles_kernel[(plan.grid_m, triton.cdiv(inter, block_n))](
            planes, b, y, out, plan.order, plan.tiles, plan.count, plan.tiles.shape[1], plan.grid_m, inter, splits, planes.stride(0), planes.stride(1),
            b.stride(0), b.stride(1), y.stride(0), out.stride(0), RANK=rank, BLOCK_M=dispatch.tile_rows(num_tokens),
            BLOCK_N=block_n, IEEE=b.dtype == torch.float32, UNROLL=dispatch.TILE_SPLITS_UNROLL,
            SPLITS_MAX=dispatch._splits_max(splits),
            num_warps=dispatch._tile_warps(dispatch.tile_rows(num_tokens), 2 * block_n))
    return out
