"""Triton kernel: the TP all-reduce, the residual add and RMSNorm after it, in one launch.

Each rank holds a partial sum of a row-parallel linear's output ([T, n], the activation dtype).
Program p of every rank handles the same rows, so the ranks' programs pair up one to one:
1. copy its rows of the local partial into this rank's symmetric buffer, in half `c % 2`, where
   c counts how often program p has run on this rank (`counters[p]`, local, the same on every
   rank since the ranks launch the same kernels);
2. signal: write c + 1 into slot [p, rank] of every rank's signal area (release, system scope),
   then wait until its own slots [p, r] of every rank r reach c + 1 (acquire);
3. sum the rows of every rank's buffer in rank order in float32 (every rank gets the same bits),
   add them to the residual (float32 stream, unrounded), store the new residual in place and
   RMSNorm of it in the activation dtype (HF's roundings, as `triton_ops.rms_norm`);
4. counters[p] = c + 1.
No closing barrier: the two halves alternate, and a rank writes half c % 2 again (at c + 2) only
after its peers signalled c + 1, which they do after finishing call c's reads (same stream).

PUSH (a variant, `TOKENMILL_ALL_REDUCE_NORM_PUSH=1`): in step 1 each rank stores its rows into
slot `rank` of half c % 2 of every rank's buffer (remote stores, which do not wait for a reply),
so that in step 3 every read is local: one NVLink round trip less per call. A half then holds
WORLD slots of the message. The same counters and signals order it: a rank's slot in a peer's
half c % 2 is written again only at c + 2, after that peer signalled c + 1, i.e. had finished
call c's reads.

Buffer layout per rank (bytes): [half 0 | half 1 | int32 signal slots [MAX_PROGRAMS, world]].
`peers` holds every rank's buffer address (int64), so the kernel reads and signals the peers
through the pointers torch's symmetric memory maps into this process; on CPU (tests, Triton's
interpreter) ordinary tensors stand in for the peers.

Requires triton at import; `all_reduce_norm` imports this module lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PROGRAMS = 4096
TILE_ELEMENTS = 2048  # as `triton_ops.rms_norm`: rows packed until a program holds this many


@triton.jit
def _buffer(peers_ptr, rank, dtype: tl.constexpr):
    """Rank `rank`'s buffer as a pointer to `dtype` (16-byte aligned: the kernel's vector loads)."""
    return tl.multiple_of(tl.load(peers_ptr + rank).to(tl.pointer_type(dtype)), 16)


@triton.jit
def tile_rows(t, num_rows, N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Tile t's ROWS rows of a [num_rows, N] row-major tensor: (element offsets [ROWS, BLOCK], mask).
    Shared by this kernel and the lamport one (`all_reduce_norm_lamport`)."""
    rows = (t * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < N)[None, :]
    return (rows * N)[:, None] + cols[None, :], mask


@triton.jit
def add_rms_norm_store(total, res_ptr, w, out_ptr, tile, mask, inv_n, eps):
    """The epilogue both kernels share: the ranks' float32 sum `total` added to the residual (stored in
    place, in its dtype), then RMSNorm of it with HF's roundings times `w` (float32 [BLOCK]) into out
    (the activation dtype)."""
    add_rms_norm_store_loaded(tl.load(res_ptr + tile, mask=mask, other=0.0), total, res_ptr, w, out_ptr, tile,
                              mask, inv_n, eps)


@triton.jit
def add_rms_norm_store_loaded(residual, total, res_ptr, w, out_ptr, tile, mask, inv_n, eps):
    """`add_rms_norm_store` with the residual's tile already loaded (`residual`, in its dtype): a
    kernel may issue that load before it waits for its peers."""
    dtype = out_ptr.dtype.element_ty
    res_ptrs = res_ptr + tile
    summed = (residual.to(tl.float32) + total).to(res_ptr.dtype.element_ty)
    tl.store(res_ptrs, summed, mask=mask)
    h = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=1) * inv_n + eps)
    normed = (h * rstd[:, None]).to(dtype).to(tl.float32)
    tl.store(out_ptr + tile, (normed * w[None, :]).to(dtype), mask=mask)


@triton.jit(do_not_specialize=["num_rows", "rank"])
def _all_reduce_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, peers_ptr, counters_ptr,
    num_rows, rank, inv_n, eps,
    half_elems,  # elements of the activation dtype in one half of a rank's buffer
    N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, WORLD: tl.constexpr,
    SIGNAL_OFFSET: tl.constexpr,  # int32 elements from a buffer's start to its signal slots
    PUSH: tl.constexpr = False,
):
    dtype = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    count = tl.load(counters_ptr + pid)
    tile, mask = tile_rows(pid, num_rows, N, BLOCK, ROWS)
    offs = (count % 2).to(tl.int64) * half_elems + tile

    own = _buffer(peers_ptr, rank, dtype)
    x = tl.load(x_ptr + tile, mask=mask, other=0.0)
    slot_elems = half_elems // WORLD  # PUSH: one slot per rank in each half
    if PUSH:
        for peer in tl.static_range(WORLD):
            tl.store(_buffer(peers_ptr, peer, dtype) + offs + rank * slot_elems, x, mask=mask)
    else:
        tl.store(own + offs, x, mask=mask)

    tl.debug_barrier()  # every thread's rows are stored before thread 0's release below
    slot = pid * WORLD
    for peer in tl.static_range(WORLD):
        signals = tl.load(peers_ptr + peer).to(tl.pointer_type(tl.int32)) + SIGNAL_OFFSET
        tl.atomic_xchg(signals + slot + rank, count + 1, sem="release", scope="sys")
    own_signals = tl.load(peers_ptr + rank).to(tl.pointer_type(tl.int32)) + SIGNAL_OFFSET + slot
    for peer in tl.static_range(WORLD):
        seen = tl.atomic_add(own_signals + peer, 0, sem="acquire", scope="sys")
        while seen < count + 1:
            seen = tl.atomic_add(own_signals + peer, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # (the atomics run on one thread; the others wait here)

    total = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for peer in tl.static_range(WORLD):
        if PUSH:  # every rank's rows in this rank's own buffer
            part = tl.load(own + offs + peer * slot_elems, mask=mask, other=0.0, volatile=True)
        else:
            part = tl.load(_buffer(peers_ptr, peer, dtype) + offs, mask=mask, other=0.0, volatile=True)
        total += part.to(tl.float32)  # (volatile: not from L1, which may hold the half's previous rows)

    cols = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    add_rms_norm_store(total, res_ptr, w, out_ptr, tile, mask, inv_n, eps)
    tl.store(counters_ptr + pid, count + 1)


def rows_per_program(n: int) -> int:
    return min(max(TILE_ELEMENTS // triton.next_power_of_2(n), 1), 64)


def num_programs(num_rows: int, n: int) -> int:
    return triton.cdiv(num_rows, rows_per_program(n))


def launch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, peers: torch.Tensor,
           counters: torch.Tensor, rank: int, world: int, half_bytes: int, push: bool = False) -> torch.Tensor:
    """Normed rows in x's dtype; `residual` updated in place. x: [T, n] contiguous partial sums;
    residual: [T, n] contiguous, float32 or x's dtype. The caller checked sizes (`FusedAllReduceNorm.applies`)."""
    num_rows, n = x.shape
    out = torch.empty_like(x)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(n)
    rows = rows_per_program(n)
    grid = triton.cdiv(num_rows, rows)
    _all_reduce_add_rms_norm_kernel[(grid,)](
        x, residual, weight, out, peers, counters,
        num_rows, rank, 1.0 / n, eps, half_bytes // x.element_size(),
        N=n, BLOCK=block, ROWS=rows, WORLD=world, SIGNAL_OFFSET=2 * half_bytes // 4, PUSH=push,
        num_warps=min(max(block * rows // 256, 1), 16),
    )
    return out
