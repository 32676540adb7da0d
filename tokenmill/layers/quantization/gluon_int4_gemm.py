"""Gluon kernel (Hopper, experimental): the W4A16 GEMM of `triton_int4_dot_gemm` with the weight
tile's dequantization overlapping the tensor cores inside one CTA.

Plain Triton waits for every wgmma whose operand was made in registers before the next K step
(`warpgroup.wait 0`), so a CTA alternates dequantizing and multiplying. Here the shared memory is
explicit: x tiles, the packed words and the packed scales / offsets stream through a ring of
`cp.async` stages; each step's dequantized tile goes to one of two B buffers and its wgmma is left
in flight (`warpgroup_mma_wait(1)`) while the next step's words are dequantized into the other.
Same layout, PTX dequantization and rounding as `triton_int4_dot_gemm` (DEQ 2); no split-K.
GPUs only (Gluon has no interpreter): scripts/gpu_int4_gemm.py checks it against the float32
reference before timing it. Torch reference: `int4_packing.dequantize` then a matmul.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from tokenmill.layers.quantization.triton_int4_dot_gemm import (
    _ASM_BF16,
    GluonTiles,
    _cached_scale_offset,
)

_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # the CTA barrier: renamed in 3.7


@gluon.jit
def _join8(o0, o1, o2, o3, o4, o5, o6, o7):
    return gl.join(gl.join(gl.join(o0, o1), gl.join(o2, o3)), gl.join(gl.join(o4, o5), gl.join(o6, o7)))


@gluon.jit
def split_k_store(part, out_ptr, part_ptr, cnt_ptr, o_off, p_off, o_mask, pid, pid_k, split, M, N,
                  out_l: gl.constexpr):
    """The Gluon INT4 GEMMs' split-K epilogue (`store_tile`'s and `gluon_int4_swap_gemm.store_tile_t`'s), as
    `triton_split_k.store_tile`: slice pid_k's fp32 partial `part` (in layout out_l) stored at p_off of
    its [M, N] slot, then the last slice to arrive at CTA pid's counter (`cnt_ptr[pid]`, left zeroed)
    sums the `split` slices in slice order and stores the bf16 tile at o_off of out."""
    R: gl.constexpr = part.shape[0]
    C: gl.constexpr = part.shape[1]
    mn = N.to(gl.int64) * M
    gl.store(part_ptr + pid_k * mn + p_off, part, mask=o_mask)
    _barrier()
    arrived = gl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
    if arrived == split - 1:
        total = gl.zeros([R, C], gl.float32, layout=out_l)
        for sl in range(split):
            total += gl.load(part_ptr + sl * mn + p_off, mask=o_mask, other=0.0, cache_modifier=".cg")
        gl.store(out_ptr + o_off, total.to(gl.bfloat16), mask=o_mask)
        gl.atomic_xchg(cnt_ptr + pid, 0)


@gluon.jit
def store_tile(acc, out_ptr, part_ptr, cnt_ptr, off_m, off_n, M, N, s_om, SPLIT_K: gl.constexpr):
    """The output tile [BM, BN] at (off_m, off_n), rows past M masked (this GEMM's epilogue). SPLIT_K (grid
    axis 1 the K slices), as `triton_split_k.store_tile`: each slice's fp32 partial, then the last slice to
    arrive (counter `cnt_ptr[pid]`, left zeroed) sums them in slice order."""
    BM: gl.constexpr = acc.shape[0]
    BN: gl.constexpr = acc.shape[1]
    out_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    om = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, out_l))
    on = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, out_l))
    o_off = gl.expand_dims(om.to(gl.int64) * s_om, 1) + gl.expand_dims(on, 0)
    o_mask = gl.expand_dims(om < M, 1)
    if SPLIT_K:
        pid = gl.program_id(0)
        pid_k = gl.program_id(1)
        split = gl.num_programs(1)
        p_off = gl.expand_dims(om.to(gl.int64) * N, 1) + gl.expand_dims(on, 0)
        split_k_store(gl.convert_layout(acc, out_l), out_ptr, part_ptr, cnt_ptr, o_off, p_off, o_mask, pid, pid_k,
                      split, M, N, out_l)
    else:
        gl.store(out_ptr + o_off, gl.convert_layout(acc.to(gl.bfloat16), out_l), mask=o_mask)


@gluon.jit
def _issue(x_smem, w_smem, lo_smem, hi_smem, x_ptrs, w_ptrs, sz_ptrs, m_mask, step, slot, N,
           BK: gl.constexpr, GROUP: gl.constexpr):
    """K tile `step`'s (global) x tile, words (BK / 64 layout steps) and packed scales into stage `slot`."""
    k0 = step * BK
    cp.async_copy_global_to_shared(x_smem.index(slot), x_ptrs + k0, mask=m_mask)
    cp.async_copy_global_to_shared(w_smem.index(slot), w_ptrs + step * (BK // 64) * 128)
    grp = k0 // GROUP
    cp.async_copy_global_to_shared(lo_smem.index(slot), sz_ptrs + grp * N)
    cp.async_copy_global_to_shared(hi_smem.index(slot), sz_ptrs + grp * N + 8)


@gluon.jit
def _step(acc, i, n_k, s0, x_smem, w_smem, lo_smem, hi_smem, b_smem, x_ptrs, w_ptrs, sz_ptrs, m_mask, N,
          w_ld: gl.constexpr, sz_ld: gl.constexpr, BK: gl.constexpr, BN: gl.constexpr, GROUP: gl.constexpr,
          STAGES: gl.constexpr):
    """K step i: its stage's words dequantized into B buffer i % 2, its wgmma left in flight once
    step i - 1's is done, then step i + STAGES - 1's loads issued into the stage step i - 1 freed."""
    slot = i % STAGES
    cp.wait_group(STAGES - 2)
    gl.thread_barrier()
    words = w_smem.index(slot).load(w_ld)
    lo = gl.expand_dims(gl.expand_dims(gl.expand_dims(lo_smem.index(slot).load(sz_ld), 1), 3), 4)
    hi = gl.expand_dims(gl.expand_dims(gl.expand_dims(hi_smem.index(slot).load(sz_ld), 1), 3), 4)
    lo, _ = gl.broadcast(lo, words)
    hi, _ = gl.broadcast(hi, words)
    o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
        _ASM_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [words, lo, hi],
        dtype=(gl.bfloat16,) * 8, is_pure=True, pack=2)
    v = _join8(o0, o1, o2, o3, o4, o5, o6, o7)  # [CB, S2, g, j, m, hi, a, b]
    w = gl.reshape(gl.permute(v, (1, 3, 4, 6, 7, 0, 5, 2)), (BK, BN))
    b = b_smem.index(i % 2)
    b.store(w)
    fence_async_shared()
    gl.thread_barrier()
    acc = warpgroup_mma(x_smem.index(slot), b, acc, use_acc=i > 0, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
    nxt = gl.minimum(i + STAGES - 1, n_k - 1)  # past the end: step n_k - 1 again, into a free stage
    _issue(x_smem, w_smem, lo_smem, hi_smem, x_ptrs, w_ptrs, sz_ptrs, m_mask, s0 + nxt, (i + STAGES - 1) % STAGES,
           N, BK, GROUP)
    cp.commit_group()
    return acc


@gluon.jit(do_not_specialize=["M"])  # one compile per launch serves every row count
def _gluon_gemm_kernel(x_ptr, w_ptr, sz_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, s_xm, s_om, GROUP: gl.constexpr,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                       SPLIT_K: gl.constexpr):
    CB: gl.constexpr = BN // 16
    S2: gl.constexpr = BK // 64
    num_warps: gl.constexpr = gl.num_warps()
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    split = gl.num_programs(1)
    tiles_m = gl.cdiv(M, BM)
    pid_m = pid % tiles_m
    pid_n = pid // tiles_m

    x_ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    w_ld: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 4], [1, 1, 8, 4, 1], [num_warps, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    L4: gl.constexpr = gl.SliceLayout(4, w_ld)  # [CB, S2, 8, 4]
    L3: gl.constexpr = gl.SliceLayout(3, L4)  # [CB, S2, 8]
    L2: gl.constexpr = gl.SliceLayout(2, L3)  # [CB, S2]
    sz_ld: gl.constexpr = gl.SliceLayout(1, L3)  # [CB, 8]
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, BN, 16])

    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK],
                                       gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16))
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, CB, S2, 8, 4, 4],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[4, 3, 2, 1, 0]))
    lo_smem = gl.allocate_shared_memory(gl.int32, [STAGES, CB, 8],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    hi_smem = gl.allocate_shared_memory(gl.int32, [STAGES, CB, 8],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BK, BN],
                                       gl.NVMMASharedLayout.get_default_for([BK, BN], gl.bfloat16))

    # x tile pointers [BM, BK]
    rm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, x_ld))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, x_ld))
    x_ptrs = x_ptr + gl.expand_dims(rm.to(gl.int64) * s_xm, 1) + gl.expand_dims(rk, 0)
    m_mask = gl.expand_dims(rm < M, 1)
    # word tile pointers [CB, S2 steps, 8 g, 4 j, 4 m] of K tile 0
    cb = gl.arange(0, CB, layout=gl.SliceLayout(1, L2))
    s2 = gl.arange(0, S2, layout=gl.SliceLayout(0, L2))
    base2 = gl.expand_dims((pid_n * CB + cb).to(gl.int64) * ((K // 64) * 128), 1) + gl.expand_dims(s2 * 128, 0)
    g8 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    base3 = gl.expand_dims(base2, 2) + gl.expand_dims(gl.expand_dims(g8 * 16, 0), 1)
    j4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    base4 = gl.expand_dims(base3, 3) + gl.expand_dims(gl.expand_dims(gl.expand_dims(j4 * 4, 0), 1), 2)
    m4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, w_ld)))))
    w_ptrs = w_ptr + gl.expand_dims(base4, 4) + \
        gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(m4, 0), 1), 2), 3)
    # packed scale / offset pointers [CB, 8] (channel 16 cb + g; + 8 for the odd nibbles)
    scb = gl.arange(0, CB, layout=gl.SliceLayout(1, sz_ld))
    sg = gl.arange(0, 8, layout=gl.SliceLayout(0, sz_ld))
    sz_ptrs = sz_ptr + gl.expand_dims((pid_n * CB + scb) * 16, 1) + gl.expand_dims(sg, 0)

    n_k = K // BK // split  # K steps per slice (the wrapper makes the split divide them)
    s0 = pid_k * n_k
    for s in gl.static_range(STAGES - 1):
        _issue(x_smem, w_smem, lo_smem, hi_smem, x_ptrs, w_ptrs, sz_ptrs, m_mask, s0 + gl.minimum(s, n_k - 1), s, N,
               BK, GROUP)
        cp.commit_group()
    acc = gl.zeros([BM, BN], gl.float32, layout=acc_l)
    # step 0 peeled: on every path the accumulator's last writer before the final wait is a wgmma
    # (ptxas serializes all wgmmas when a zero-trip path defines it in between)
    acc = _step(acc, 0, n_k, s0, x_smem, w_smem, lo_smem, hi_smem, b_smem, x_ptrs, w_ptrs, sz_ptrs, m_mask, N,
                w_ld, sz_ld, BK, BN, GROUP, STAGES)
    for i in range(1, n_k):
        acc = _step(acc, i, n_k, s0, x_smem, w_smem, lo_smem, hi_smem, b_smem, x_ptrs, w_ptrs, sz_ptrs, m_mask, N,
                    w_ld, sz_ld, BK, BN, GROUP, STAGES)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    cp.wait_group(0)

    store_tile(acc, out_ptr, part_ptr, cnt_ptr, pid_m * BM, pid_n * BN, M, N, s_om, SPLIT_K)


def gluon_gemm(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               tiles: GluonTiles | None = None, sz: torch.Tensor | None = None,
               counters: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 @ W^T -> [M, N]; W in the mma layout, scales / zeros [G, N] bf16 (or `sz` from
    `triton_int4_dot_gemm.packed_scale_offset`). CUDA and bf16 only. tiles.split > 1: K cut into
    that many slices (the largest dividing K / 64 up to it), needs `counters` (zeroed int32, one per
    output tile; without them, or too few, no split)."""
    t = tiles or GluonTiles()
    block_m, block_n = t.block_m, t.block_n
    m, k = x.shape
    n = qm.shape[0] * 16
    group = k if group_size == -1 else group_size
    if x.dtype != torch.bfloat16 or n % block_n or t.block_k not in (64, 128) or group % t.block_k or k % group:
        raise ValueError(f"gluon int4 GEMM: bf16 x, N a multiple of {block_n}, K and the group of 64 (x {x.dtype}, "
                         f"N {n}, K {k}, group {group})")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x = x.contiguous()
    if sz is None:
        sz = _cached_scale_offset(scales, zeros)
    tiles = triton.cdiv(m, block_m) * (n // block_n)
    split = t.split if counters is not None and counters.numel() >= tiles else 1
    while (k // t.block_k) % split:
        split -= 1
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _gluon_gemm_kernel[(tiles, split)](x, qm, sz, out, part, counters if split > 1 else out, m, n, k, x.stride(0),
                                       out.stride(0), GROUP=group, BM=block_m, BN=block_n, BK=t.block_k,
                                       STAGES=t.stages,
                                       SPLIT_K=split > 1, num_warps=t.warps)
    return out
