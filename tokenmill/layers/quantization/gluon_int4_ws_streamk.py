"""Gluon kernel (Hopper): the warp-specialized INT4 GEMM (`gluon_int4_ws_gemm`) on a stream-K schedule.

Why: at 256 rows the Llama linears' output tiles do not fill 132 SMs evenly (gate_up: 224 tiles of
256 x 128, 1.7 waves, the second 70% full; down / qkv / o: 32-48 tiles, which a fixed split-K cuts
into equal slices of whole tiles only). Here the grid is G CTAs (one an SM) and the U = tiles x
steps K steps are cut into G equal contiguous ranges: CTA c runs steps [c U / G, (c + 1) U / G),
i.e. the tail of one tile, whole tiles, the head of another. The three partitions (TMA loader,
dequantizers, wgmma consumer) walk the same segments through the same rings as the plain kernel; the
consumer stores a whole tile in bf16 at once, and a partial tile's fp32 sum into slot
c - c(first step of the tile) of a workspace; the last of the tile's segments to arrive (a counter per
tile, reset by it) sums the slots in K order and stores the tile. The step -> CTA map (`cta_of`) and
the segment walk are mirrored on the CPU by `segments` (tests/layers/test_int4_ws_gemm.py).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tokenmill.layers.quantization.gluon_int4_ws_gemm import (
    _barrier,
    _dequant_tile,
    _load_step,
    _tma_load,
)
from tokenmill.layers.quantization.int4_ws_route import WsTiles
from tokenmill.layers.quantization.triton_int4_dot_gemm import _cached_scale_offset


def segments(tiles: int, n_k: int, grid: int) -> list[list[tuple[int, int, int]]]:
    """Per CTA its (tile, first step, end step) segments, in order: the kernel's walk."""
    total = tiles * n_k
    out = []
    for c in range(grid):
        u, end, seg = (c * total) // grid, ((c + 1) * total) // grid, []
        while u < end:
            t, k0 = u // n_k, u % n_k
            k1 = min(n_k, k0 + end - u)
            seg.append((t, k0, k1))
            u += k1 - k0
        out.append(seg)
    return out


def cta_of(u: int, total: int, grid: int) -> int:
    """The CTA whose range holds global step u (start_c <= u < end_c, start_c = c total // grid)."""
    return ((u + 1) * grid - 1) // total


@gluon.jit
def _cta_of(u, total, grid):
    return ((u + 1) * grid - 1) // total


@gluon.jit
def _sk_consumer(x_smem, b_smem, x_ready, b_ready, x_empty, b_empty, out_ptr, part_ptr, cnt_ptr, M, N, s_om,
                 tiles_m, n_k, total, BM: gl.constexpr, BN: gl.constexpr):
    STAGES: gl.constexpr = x_smem.shape[0]
    num_warps: gl.constexpr = gl.num_warps()
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, BN, 16])
    c = gl.program_id(0)
    grid = gl.num_programs(0)
    u = (c * total) // grid
    end = ((c + 1) * total) // grid
    it = 0
    mn = N.to(gl.int64) * M
    while u < end:
        t = u // n_k
        k0 = u % n_k
        k1 = gl.minimum(n_k, k0 + end - u)
        acc = gl.zeros([BM, BN], gl.float32, layout=acc_l)
        s = it % STAGES
        mbarrier.wait(x_ready.index(s), (it // STAGES) & 1)
        mbarrier.wait(b_ready.index(s), (it // STAGES) & 1)
        acc = warpgroup_mma(x_smem.index(s), b_smem.index(s), acc, use_acc=False, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        for j in range(1, k1 - k0):
            s = (it + j) % STAGES
            ph = ((it + j) // STAGES) & 1
            mbarrier.wait(x_ready.index(s), ph)
            mbarrier.wait(b_ready.index(s), ph)
            acc = warpgroup_mma(x_smem.index(s), b_smem.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            _barrier()
            p = (it + j - 1) % STAGES
            mbarrier.arrive(x_empty.index(p), count=1)
            mbarrier.arrive(b_empty.index(p), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        _barrier()
        p = (it + k1 - k0 - 1) % STAGES
        mbarrier.arrive(x_empty.index(p), count=1)
        mbarrier.arrive(b_empty.index(p), count=1)
        it += k1 - k0
        # the segment's epilogue (stores from the accumulator's layout; the producers run on meanwhile)
        pid_m = t % tiles_m
        pid_n = t // tiles_m
        om = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_l))
        on = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_l))
        o_mask = gl.expand_dims(om < M, 1)
        if (k1 - k0) == n_k:
            o_off = gl.expand_dims(om.to(gl.int64) * s_om, 1) + gl.expand_dims(on, 0)
            gl.store(out_ptr + o_off, acc.to(gl.bfloat16), mask=o_mask)
        else:
            first = _cta_of(t * n_k, total, grid)
            nseg = _cta_of((t + 1) * n_k - 1, total, grid) - first + 1
            p_off = gl.expand_dims(om.to(gl.int64) * N, 1) + gl.expand_dims(on, 0)
            gl.store(part_ptr + (c - first) * mn + p_off, acc, mask=o_mask)
            _barrier()
            arrived = gl.atomic_add(cnt_ptr + t, 1, sem="acq_rel")
            if arrived == nseg - 1:
                tot = gl.zeros([BM, BN], gl.float32, layout=acc_l)
                for sl in range(nseg):
                    tot += gl.load(part_ptr + sl * mn + p_off, mask=o_mask, other=0.0, cache_modifier=".cg")
                o_off = gl.expand_dims(om.to(gl.int64) * s_om, 1) + gl.expand_dims(on, 0)
                gl.store(out_ptr + o_off, tot.to(gl.bfloat16), mask=o_mask)
                gl.atomic_xchg(cnt_ptr + t, 0)
        u += k1 - k0


@gluon.jit
def _sk_loader(x_desc, w_ptr, sz_ptr, x_smem, b_smem, x_ready, b_ready, x_empty, b_empty, tiles_m, n_k, total,
               N, K, GROUP: gl.constexpr, AHEAD: gl.constexpr):
    STAGES: gl.constexpr = x_smem.shape[0]
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    c = gl.program_id(0)
    grid = gl.num_programs(0)
    u = (c * total) // grid
    end = ((c + 1) * total) // grid
    it = 0
    while u < end:
        t = u // n_k
        k0 = u % n_k
        k1 = gl.minimum(n_k, k0 + end - u)
        off_m = (t % tiles_m) * BM
        for j in range(k1 - k0):
            s = (it + j) % STAGES
            mbarrier.wait(x_empty.index(s), (((it + j) // STAGES) & 1) ^ 1)
            mbarrier.expect(x_ready.index(s), x_desc.block_type.nbytes)
            _tma_load(x_desc, [off_m, (k0 + j) * BK], x_ready.index(s), x_smem.index(s))
        it += k1 - k0
        u += k1 - k0


@gluon.jit
def _sk_dequantizer(x_desc, w_ptr, sz_ptr, x_smem, b_smem, x_ready, b_ready, x_empty, b_empty, tiles_m, n_k, total,
                    N, K, GROUP: gl.constexpr, AHEAD: gl.constexpr):
    """As `gluon_int4_ws_gemm._dequantizer`, per segment (the word prefetch restarts at each segment)."""
    STAGES: gl.constexpr = b_smem.shape[0]
    BK: gl.constexpr = b_smem.shape[1]
    BN: gl.constexpr = b_smem.shape[2]
    CB: gl.constexpr = BN // 16
    nw: gl.constexpr = gl.num_warps()
    w_ld: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 4], [1, 1, 8, 4, 1], [nw, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    L4: gl.constexpr = gl.SliceLayout(4, w_ld)
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    sz_ld: gl.constexpr = gl.SliceLayout(1, L3)
    # lane offsets of a tile's words [CB, 1, 8, 4, 4] (step 0) and of its scales [CB, 8], tile 0
    cb = gl.arange(0, CB, layout=gl.SliceLayout(1, L2))
    s1 = gl.arange(0, 1, layout=gl.SliceLayout(0, L2))
    base2 = gl.expand_dims(cb.to(gl.int64) * ((K // 64) * 128), 1) + gl.expand_dims(s1 * 128, 0)
    g8 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    base3 = gl.expand_dims(base2, 2) + gl.expand_dims(gl.expand_dims(g8 * 16, 0), 1)
    j4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    base4 = gl.expand_dims(base3, 3) + gl.expand_dims(gl.expand_dims(gl.expand_dims(j4 * 4, 0), 1), 2)
    m4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, w_ld)))))
    w_off = gl.expand_dims(base4, 4) + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(m4, 0), 1), 2), 3)
    scb = gl.arange(0, CB, layout=gl.SliceLayout(1, sz_ld))
    sg = gl.arange(0, 8, layout=gl.SliceLayout(0, sz_ld))
    sz_off = gl.expand_dims(scb * 16, 1) + gl.expand_dims(sg, 0)
    c = gl.program_id(0)
    grid = gl.num_programs(0)
    u = (c * total) // grid
    end = ((c + 1) * total) // grid
    it = 0
    while u < end:
        t = u // n_k
        k0 = u % n_k
        k1 = gl.minimum(n_k, k0 + end - u)
        pid_n = t // tiles_m
        w_ptrs = w_ptr + pid_n.to(gl.int64) * (CB * (K // 64) * 128) + w_off
        sz_ptrs = sz_ptr + pid_n * BN + sz_off
        last = k1 - 1
        wa, la, ha = _load_step(w_ptrs, sz_ptrs, k0, N, BK, GROUP, sz_ld)
        wb, lb, hb = _load_step(w_ptrs, sz_ptrs, gl.minimum(k0 + 1, last), N, BK, GROUP, sz_ld)
        wc, lc, hc = _load_step(w_ptrs, sz_ptrs, gl.minimum(k0 + 2, last), N, BK, GROUP, sz_ld)
        for j in range(k1 - k0):
            wn, ln, hn = _load_step(w_ptrs, sz_ptrs, gl.minimum(k0 + j + AHEAD, last), N, BK, GROUP, sz_ld)
            w = _dequant_tile(wa, la, ha, BK, BN)
            s = (it + j) % STAGES
            mbarrier.wait(b_empty.index(s), (((it + j) // STAGES) & 1) ^ 1)
            b_smem.index(s).store(w)
            fence_async_shared()
            _barrier()
            mbarrier.arrive(b_ready.index(s), count=1)
            if AHEAD == 1:
                wa, la, ha = wn, ln, hn
            elif AHEAD == 2:
                wa, la, ha = wb, lb, hb
                wb, lb, hb = wn, ln, hn
            else:
                wa, la, ha = wb, lb, hb
                wb, lb, hb = wc, lc, hc
                wc, lc, hc = wn, ln, hn
        it += k1 - k0
        u += k1 - k0


@gluon.jit(do_not_specialize=["M"])
def _ws_streamk_kernel(x_desc, w_ptr, sz_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, s_om, GROUP: gl.constexpr,
                       BN: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr, DEQ_WARPS: gl.constexpr,
                       DEQ_REGS: gl.constexpr):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    tiles_m = gl.cdiv(M, BM)
    n_k = K // BK
    total = tiles_m * (N // BN) * n_k
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], x_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BK, BN],
                                       gl.NVMMASharedLayout.get_default_for([BK, BN], gl.bfloat16))
    x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(x_ready.index(s), count=1)
        mbarrier.init(b_ready.index(s), count=1)
        mbarrier.init(x_empty.index(s), count=1)
        mbarrier.init(b_empty.index(s), count=1)
    fence_async_shared()
    worker_args = (x_desc, w_ptr, sz_ptr, x_smem, b_smem, x_ready, b_ready, x_empty, b_empty, tiles_m, n_k, total,
                   N, K, GROUP, AHEAD)
    gl.warp_specialize([
        (_sk_consumer, (x_smem, b_smem, x_ready, b_ready, x_empty, b_empty, out_ptr, part_ptr, cnt_ptr, M, N, s_om,
                        tiles_m, n_k, total, BM, BN)),
        (_sk_loader, worker_args),
        (_sk_dequantizer, worker_args),
    ], [1, DEQ_WARPS], [24, DEQ_REGS])


@functools.lru_cache(maxsize=256)
def max_segments(tiles: int, n_k: int, grid: int) -> int:
    """The most CTAs sharing one tile (the workspace's slots)."""
    total = tiles * n_k
    return max(cta_of((t + 1) * n_k - 1, total, grid) - cta_of(t * n_k, total, grid) + 1 for t in range(tiles))


def ws_streamk_gemm(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    tiles: WsTiles, counters: torch.Tensor, sz: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 @ W^T -> [M, N] on `tiles.sk` CTAs (stream-K); `counters`: zeroed int32, one per
    output tile (left zeroed)."""
    t = tiles
    m, k = x.shape
    n = qm.shape[0] * 16
    group = k if group_size == -1 else group_size
    n_tiles = triton.cdiv(m, t.bm) * (n // t.bn) if m else 0
    if (x.dtype != torch.bfloat16 or n % t.bn or group % 64 or k % group or t.ahead not in (1, 2, 3) or t.sk < 1
            or counters.numel() < n_tiles):
        raise ValueError(f"ws stream-K int4 GEMM: bf16 x, N a multiple of {t.bn}, K and the group of 64, ahead 1-3, "
                         f"sk >= 1, a counter per tile (x {x.dtype}, N {n}, K {k}, group {group}, {t.label()}, "
                         f"{counters.numel()} counters for {n_tiles} tiles)")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1 or (x.stride(0) * 2) % 16:
        x = x.contiguous()
    if sz is None:
        sz = _cached_scale_offset(scales, zeros)
    grid = min(t.sk, n_tiles * (k // 64))
    part = torch.empty((max_segments(n_tiles, k // 64, grid), m, n), dtype=torch.float32, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, [t.bm, 64], gl.NVMMASharedLayout.get_default_for([t.bm, 64],
                                                                                               gl.bfloat16))
    _ws_streamk_kernel[(grid,)](x_desc, qm, sz, out, part, counters, m, n, k, out.stride(0), GROUP=group, BN=t.bn,
                                STAGES=t.stages, AHEAD=t.ahead, DEQ_WARPS=t.deq_warps, DEQ_REGS=t.deq_regs,
                                num_warps=t.warps)
    return out
