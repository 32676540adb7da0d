"""Gluon kernel (Hopper): the swapped W4A16 GEMM warp-specialized (issue 22, 256 rows):
out^T [N, M] = W [N, K] @ x^T, the weight dequantized in registers as wgmma's A operand.

Why: `gluon_int4_swap_gemm` (the weight from global memory into registers, dequantized there as the
register A operand, x^T from shared memory) runs each 64-input step as one serial chain in one set of
warps (x's cp.async wait, a CTA barrier, the dequantization, the wgmma issue / retire): the tensor
cores idle between steps. Session 10's warp-specialized GEMM (retired in session 12) kept the other
orientation, and its dequantizers' B tiles through shared memory were its limit. Here (the mixed-input design of Hopper
GEMMs: the narrow operand converted in registers) the chain is cut in two partitions that meet only
at mbarriers of one shared-memory ring:
- the loader (1 warp): per step, x's [BT, 64] tile (x already in the fragment's K order, written so
  by the norm / SiLU-and-mul: `int4_kperm`; rows past M zero-filled), the step's words ([CB, 128]
  int32 of the mma layout) and its group's packed scales / offsets ([1, BC]) by TMA into one slot,
  as soon as the consumers free it;
- the consumers (the kernel's warps: `wgs` warpgroups, warp w the 16-channel blocks w, w + W, ...):
  the slot's words from shared memory into registers (one 16-byte read a lane and block), dequantized
  there into wgmma's register A fragment (`gluon_int4_swap_gemm._dequant`: `int4_packing.to_mma`'s
  word order is the fragment order), the wgmma issued on x^T from the slot, the previous step's wgmma
  retired and its slot freed. So step i + 1 is dequantized while wgmma i runs, and the only barrier
  in the loop is the consumer warps' own (before the one-thread arrive that frees a slot).
Split-K (grid axis 1) for the skinny linears as `gluon_int4_swap_gemm`: fp32 partials, the last slice
to arrive sums them in slice order. bf16 only; GPUs only (Gluon has no interpreter):
tests/layers/test_int4_wsa_gemm.py checks the K order and fragment map on the CPU (`emulate`, the swap
GEMM's: the same words, the same x order) and compiles the kernel for sm_90 offline;
scripts/gpu_int4_wsa.py checks every launch against a float32 reference on the GPU.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tokenmill.layers.quantization.gluon_int4_swap_gemm import _dequant, store_tile_t
from tokenmill.layers.quantization.int4_wsa_route import WsaTiles
from tokenmill.layers.quantization.triton_int4_dot_gemm import _cached_scale_offset

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # 3.7+: renamed
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # 3.6: `_reinterpret`
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # the calling partition's warps (3.7: renamed)
_PLAIN32 = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)  # TMA tiles of words / scales


@gluon.jit
def _loader(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, w_view, s_view, ready, empty, off_t, off_cb, s0, n_k,
            GROUP: gl.constexpr):
    """Ring step i (slot i % STAGES): x's tile, the words and the scales of K step s0 + i, one barrier."""
    STAGES: gl.constexpr = x_smem.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes
    for i in range(n_k):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        k = s0 + i
        _tma_load(x_desc, [off_t, k * BK], ready.index(s), x_smem.index(s))
        _tma_load(w_desc, [off_cb, k * 128], ready.index(s), w_smem.index(s))
        _tma_load(s_desc, [(k * BK) // GROUP, off_cb * 16], ready.index(s), s_smem.index(s))


@gluon.jit
def _fragment(i, x_smem, w_view, s_view, ready, a_l: gl.constexpr, BC: gl.constexpr):
    """Step i's A fragment: once its slot landed, the words and scales from shared memory (word m of
    lane (g, j) of block cb at [cb, 0, g, j, m]; channel 16 cb + c's scale at [cb, c]), dequantized."""
    STAGES: gl.constexpr = x_smem.shape[0]
    W: gl.constexpr = gl.num_warps()
    w_ld: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 4], [1, 1, 8, 4, 1], [W, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    sz_ld: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, w_ld)))  # [CB, 8]
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    words = w_view.index(s).load(w_ld)
    scales = s_view.index(s)
    lo = scales.slice(0, 8, dim=1).load(sz_ld)
    hi = scales.slice(8, 8, dim=1).load(sz_ld)
    return _dequant(words, lo, hi, a_l, BC, 64)


@gluon.jit
def _step(j, g, acc, x_smem, w_view, s_view, ready, empty, a_l: gl.constexpr, BC: gl.constexpr,
          DEPTH: gl.constexpr):
    """Step j of a run of steps (ring step g): its A fragment (made while the DEPTH wgmmas before it
    run), its wgmma (A in registers, B = x^T of the slot) left in flight, then wgmma g - DEPTH retired
    and (j >= DEPTH: of this run) its slot freed once every consumer warp retired it (the partition's
    barrier, then one thread's arrive)."""
    STAGES: gl.constexpr = x_smem.shape[0]
    a = _fragment(g, x_smem, w_view, s_view, ready, a_l, BC)
    acc = warpgroup_mma(a, x_smem.index(g % STAGES).permute((1, 0)), acc, use_acc=j > 0, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=DEPTH, deps=[acc])
    if j >= DEPTH:
        _barrier()
        mbarrier.arrive(empty.index((g - DEPTH) % STAGES), count=1)
    return acc


@gluon.jit
def _deep_steps(g0, n, acc, x_smem, w_view, s_view, ready, empty, a_l: gl.constexpr, BC: gl.constexpr):
    """n >= 2 steps with two wgmmas in flight: two heads, triples, up to two tails (ptxas pipelines
    them only where the second head is unconditional)."""
    acc = _step(0, g0, acc, x_smem, w_view, s_view, ready, empty, a_l, BC, 2)
    acc = _step(1, g0 + 1, acc, x_smem, w_view, s_view, ready, empty, a_l, BC, 2)
    for j in range(2, n - 2, 3):
        acc = _step(j, g0 + j, acc, x_smem, w_view, s_view, ready, empty, a_l, BC, 2)
        acc = _step(j + 1, g0 + j + 1, acc, x_smem, w_view, s_view, ready, empty, a_l, BC, 2)
        acc = _step(j + 2, g0 + j + 2, acc, x_smem, w_view, s_view, ready, empty, a_l, BC, 2)
    r = (n - 2) % 3  # steps after the heads and the triples
    if r >= 1:
        acc = _step(n - r, g0 + n - r, acc, x_smem, w_view, s_view, ready, empty, a_l, BC, 2)
    if r == 2:
        acc = _step(n - 1, g0 + n - 1, acc, x_smem, w_view, s_view, ready, empty, a_l, BC, 2)
    return acc


@gluon.jit
def _steps(g0, n, acc, x_smem, w_view, s_view, ready, empty, a_l: gl.constexpr, BC: gl.constexpr,
           DEPTH: gl.constexpr, ONE: gl.constexpr = False):
    """A run of n K steps into acc (ring steps g0 .. g0 + n - 1; n >= 2, or n >= 1 where ONE), DEPTH
    (1 or 2) wgmmas left in flight behind the one issued; the last retired and the run's last slots
    freed before it returns. The steps are unrolled DEPTH + 1 a trip, with peeled heads and tails:
    every call site dequantizes into registers of its own, which the wgmmas still in flight (the DEPTH
    call sites before it) never read (ptxas serializes the wgmmas where it cannot keep them apart:
    tests/layers/test_int4_wsa_gemm.py checks the SASS)."""
    STAGES: gl.constexpr = x_smem.shape[0]
    if DEPTH == 1:
        acc = _step(0, g0, acc, x_smem, w_view, s_view, ready, empty, a_l, BC, 1)
        for j in range(1, n - 1, 2):
            acc = _step(j, g0 + j, acc, x_smem, w_view, s_view, ready, empty, a_l, BC, 1)
            acc = _step(j + 1, g0 + j + 1, acc, x_smem, w_view, s_view, ready, empty, a_l, BC, 1)
        if n % 2 == 0:  # n - 1 steps after the first: pairs and one
            acc = _step(n - 1, g0 + n - 1, acc, x_smem, w_view, s_view, ready, empty, a_l, BC, 1)
    elif ONE:
        if n >= 2:
            acc = _deep_steps(g0, n, acc, x_smem, w_view, s_view, ready, empty, a_l, BC)
        else:
            acc = _step(0, g0, acc, x_smem, w_view, s_view, ready, empty, a_l, BC, 2)
    else:
        acc = _deep_steps(g0, n, acc, x_smem, w_view, s_view, ready, empty, a_l, BC)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    _barrier()
    for j in range(gl.maximum(n - DEPTH, 0), n):
        mbarrier.arrive(empty.index((g0 + j) % STAGES), count=1)
    return acc


@gluon.jit
def _consumer(x_smem, w_view, s_view, ready, empty, n_k, BC: gl.constexpr, BT: gl.constexpr, DEPTH: gl.constexpr):
    """The slice's n_k steps (`_steps`)."""
    W: gl.constexpr = gl.num_warps()
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BT, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    acc = gl.zeros([BC, BT], gl.float32, layout=acc_l)
    acc = _steps(0, n_k, acc, x_smem, w_view, s_view, ready, empty, a_l, BC, DEPTH)
    return (acc,)


@gluon.jit
def _rings(x_desc, w_desc, s_desc, STAGES: gl.constexpr):
    """The ring: x / word / scale slots (words and scales also as plain row-major views, [STAGES, CB,
    1, 8, 4, 4] and [STAGES, CB, 16] int32, for the consumers' reads) and a ready / empty barrier each."""
    BT: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    CB: gl.constexpr = w_desc.block_type.shape[0]
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BK], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, CB, 128], w_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 1, 16 * CB], s_desc.layout)
    flat5: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[4, 3, 2, 1, 0])
    flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    if _PUBLIC_REINTERPRET:
        w_view = w_smem.reinterpret(gl.int32, [STAGES, CB, 1, 8, 4, 4], flat5)
        s_view = s_smem.reinterpret(gl.int32, [STAGES, CB, 16], flat2)
    else:
        w_view = w_smem._reinterpret(gl.int32, [STAGES, CB, 1, 8, 4, 4], flat5)
        s_view = s_smem._reinterpret(gl.int32, [STAGES, CB, 16], flat2)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    return x_smem, w_smem, s_smem, w_view, s_view, ready, empty


@gluon.jit(do_not_specialize=["M"])  # one compile per launch serves every row count
def _wsa_gemm_kernel(x_desc, w_desc, s_desc, out_ptr, part_ptr, cnt_ptr, M, N, K, s_om, GROUP: gl.constexpr,
                     STAGES: gl.constexpr, SPLIT_K: gl.constexpr, DEPTH: gl.constexpr = 1, RASTER: gl.constexpr = 0):
    BT: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    CB: gl.constexpr = w_desc.block_type.shape[0]
    BC: gl.constexpr = 16 * CB
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    split = gl.num_programs(1)
    tiles_t = gl.cdiv(M, BT)
    if RASTER == 0:  # the token tiles of one weight tile side by side: its words leave HBM once
        pid_t = pid % tiles_t
        pid_c = pid // tiles_t
    else:  # groups of RASTER token tiles, each group's channel tiles in turn: its x stays in L2 (prefill)
        per_group = RASTER * (N // BC)
        first_t = (pid // per_group) * RASTER
        size_t = gl.minimum(tiles_t - first_t, RASTER)
        pid_t = first_t + (pid % per_group) % size_t
        pid_c = (pid % per_group) // size_t
    n_k = K // BK // split  # steps per slice (the wrapper makes them whole and even)
    s0 = pid_k * n_k

    x_smem, w_smem, s_smem, w_view, s_view, ready, empty = _rings(x_desc, w_desc, s_desc, STAGES)
    (acc,) = gl.warp_specialize([
        (_consumer, (x_smem, w_view, s_view, ready, empty, n_k, BC, BT, DEPTH)),
        (_loader, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, w_view, s_view, ready, empty, pid_t * BT,
                   pid_c * CB, s0, n_k, GROUP)),
    ], [1], [24])

    store_tile_t(acc, out_ptr, part_ptr, cnt_ptr, pid, pid_k, split, pid_c, pid_t, M, N, s_om, SPLIT_K)


def descriptors(x: torch.Tensor, qm: torch.Tensor, sz: torch.Tensor, t: WsaTiles) -> tuple:
    """TMA descriptors: x's [BT, 64] tiles, the words' [BC / 16, 128] tiles (qm as [N / 16, K / 64 x 128]:
    one 64-input step of BC / 16 channel blocks) and the packed scales' [1, BC] rows."""
    x_desc = TensorDescriptor.from_tensor(x, [t.bt, 64], gl.NVMMASharedLayout.get_default_for([t.bt, 64], gl.bfloat16))
    w_desc = TensorDescriptor.from_tensor(qm.view(qm.shape[0], -1), [t.bc // 16, 128], _PLAIN32)
    s_desc = TensorDescriptor.from_tensor(sz, [1, t.bc], _PLAIN32)
    return x_desc, w_desc, s_desc


def split_for(t: WsaTiles, k: int, tiles: int, counters: torch.Tensor | None) -> int:
    """The split-K slices a launch runs: t.split, lowered until each slice holds a whole, even number of
    64-input steps; 1 without enough counters (one zeroed int32 per output tile)."""
    split = t.split if counters is not None and counters.numel() >= tiles else 1
    steps = k // 64
    while steps % split or (steps // split) % 2:
        split -= 1
    return split


def checked_shape(x: torch.Tensor, qm: torch.Tensor, group_size: int, t: WsaTiles, what: str, even: bool
                  ) -> tuple[int, int, int, int]:
    """(M, N, K, group) of a product the wsa kernels take (this one and `gluon_int4_wsa_streamk`): bf16 x,
    N a multiple of the CTA's channels, K and the group multiples of 64, and (`even`: the plain kernel's
    two call sites a trip) an even number of 64-input steps; else ValueError naming `what`."""
    m, k = x.shape
    n = qm.shape[0] * 16
    group = k if group_size == -1 else group_size
    if x.dtype != torch.bfloat16 or n % t.bc or group % 64 or k % group or (even and (k // 64) % 2):
        raise ValueError(f"{what}: bf16 x, N a multiple of {t.bc}, K and the group of 64"
                         f"{', an even number of 64-input steps' if even else ''} "
                         f"(x {x.dtype}, N {n}, K {k}, group {group})")
    return m, n, k, group


def operands(x: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, sz: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x as TMA reads it (unit column stride, rows 16-byte aligned) and the packed scales / offsets."""
    if x.stride(1) != 1 or (x.stride(0) * 2) % 16:
        x = x.contiguous()
    return x, _cached_scale_offset(scales, zeros) if sz is None else sz


def wsa_gemm(x: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
             tiles: WsaTiles | None = None, sz: torch.Tensor | None = None,
             counters: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 with each 64-input step's columns in the swapped GEMM's K order
    (`gluon_int4_swap_gemm.permute_x`, or written so by `int4_kperm`'s producers) @ W^T -> [M, N];
    W in the mma layout, scales / zeros [G, N] bf16 (or `sz` from `packed_scale_offset`). CUDA, bf16,
    K and the group multiples of 64 with an even number of steps, N of the CTA's channels."""
    t = tiles or WsaTiles()
    m, n, k, group = checked_shape(x, qm, group_size, t, "wsa int4 GEMM", even=True)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x, sz = operands(x, scales, zeros, sz)
    x_desc, w_desc, s_desc = descriptors(x, qm, sz, t)
    n_tiles = triton.cdiv(m, t.bt) * (n // t.bc)
    split = split_for(t, k, n_tiles, counters)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _wsa_gemm_kernel[(n_tiles, split)](x_desc, w_desc, s_desc, out, part, counters if split > 1 else out, m, n, k,
                                       out.stride(0), GROUP=group, STAGES=t.stages, SPLIT_K=split > 1,
                                       DEPTH=t.depth, RASTER=t.raster, num_warps=4 * t.wgs)
    return out


# ----------------------------------------------------------------------------- CPU mirror


def cta_tile(pid: int, tiles_t: int, tiles_c: int, raster: int) -> tuple[int, int]:
    """(token tile, channel tile) of CTA `pid`: the kernel's order, mirrored (raster 0: the token tiles of
    one channel tile side by side; else groups of `raster` token tiles, each group's channel tiles in turn)."""
    if raster == 0:
        return pid % tiles_t, pid // tiles_t
    per_group = raster * tiles_c
    first_t = (pid // per_group) * raster
    size_t = min(tiles_t - first_t, raster)
    return first_t + (pid % per_group) % size_t, (pid % per_group) // size_t


def slot_tiles(qm: torch.Tensor, sz: torch.Tensor, step: int, pid_c: int, bc: int, group: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What one ring slot holds for K step `step` of channel tile `pid_c`, read as the consumers read it:
    the loader's word tile (qm as [N / 16, K / 64 x 128] at [pid_c CB, 128 step]) viewed [CB, 8 g, 4 j, 4 m],
    and its scale row (sz at [64 step / group, bc pid_c]) viewed [CB, 16]: lo = [:, :8] (channel 16 cb + g),
    hi = [:, 8:] (16 cb + 8 + g)."""
    cb = bc // 16
    words = qm.reshape(qm.shape[0], -1)[pid_c * cb:(pid_c + 1) * cb, step * 128:(step + 1) * 128].reshape(cb, 8, 4, 4)
    row = sz[(step * 64) // group, pid_c * bc:(pid_c + 1) * bc].reshape(cb, 16)
    return words, row[:, :8], row[:, 8:]


def emulate(xp: torch.Tensor, qm: torch.Tensor, sz: torch.Tensor, group: int, tiles: WsaTiles, split: int = 1
            ) -> torch.Tensor:
    """The kernel's product in float64 from what its slots hold (`slot_tiles`): per channel tile, K slice
    and step, each block's A tile (`gluon_int4_swap_gemm.fragment_tile`'s register map of the slot's
    words, the PTX's ((128 + q) - (128 + z)) times the scale rounded once to bf16) times xp's step
    columns (x permuted: `permute_x`), the slices summed in slice order (the split-K epilogue's)."""
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import fragment_tile

    m, k = xp.shape
    n = qm.shape[0] * 16
    bc, cb = tiles.bc, tiles.bc // 16
    n_k = k // 64 // split
    xd = xp.double().cpu()
    out = torch.zeros(m, n, dtype=torch.float64)

    def bf16(bits: torch.Tensor) -> torch.Tensor:
        return (((bits & 0xFFFF) ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16).double()

    for pid_c in range(n // bc):
        total = torch.zeros(m, bc, dtype=torch.float64)
        for p in range(split):
            acc = torch.zeros(m, bc, dtype=torch.float64)
            for step in range(p * n_k, (p + 1) * n_k):
                words, lo, hi = slot_tiles(qm, sz, step, pid_c, bc, group)
                sc = torch.cat([bf16(lo), bf16(hi)], dim=1).reshape(bc)  # channel 16 cb + c
                mz = torch.cat([bf16(lo >> 16), bf16(hi >> 16)], dim=1).reshape(bc)  # 128 + z
                q = torch.cat([fragment_tile(words.reshape(cb, 1, 32, 4), 0, b) for b in range(cb)]).double()
                w = ((q + 128.0 - mz[:, None]) * sc[:, None]).to(torch.bfloat16).double()  # [bc, 64]
                acc += xd[:, step * 64:(step + 1) * 64] @ w.t()
            total += acc
        out[:, pid_c * bc:(pid_c + 1) * bc] = total
    return out
