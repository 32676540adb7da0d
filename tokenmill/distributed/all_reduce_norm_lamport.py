"""Triton kernel: the fused TP all-reduce + residual add + RMSNorm without barriers (the "lamport" variant).

The pull and push variants (`all_reduce_norm_kernel`) order each call with signal slots: a store,
a system-scope release and an acquire spin per peer, on top of the rows' trip over NVLink. Here
the rows carry their own readiness instead: every element of a rank's buffer holds a sentinel
(the bit pattern of -0.0, 0x8000 for bf16 and fp16) until a peer's row lands in it, so a reader
spins on the data itself and the only NVLink trip is the peers' posted stores. The rows are cut
in tiles (ROWS rows at the layout's width, as `all_reduce_norm_kernel`); tile t of every rank
holds the same rows and, for its call number c (`counters[t]`, the same on every rank since the
ranks launch the same kernels):
1. its rows of the local partial, with -0.0 turned into +0.0 (so that no value equals the
   sentinel; the sum is the same number), go into slot `rank` of epoch c % 3 of every peer's
   buffer (remote stores, which do not wait for a reply);
2. its region of epoch (c + 2) % 3 of this rank's buffer is refilled with the sentinel: that
   epoch was read at call c - 1, and a peer writes it again only at call c + 2, after this rank's
   call c + 1 has sent its rows, i.e. after this launch ended (same stream);
3. every peer's slot of epoch c % 3 of this rank's buffer is read until no element is the
   sentinel; the ranks' rows are summed in rank order in float32 (its own from registers: every
   rank gets the same bits), added to the residual (stored in place) and RMSNormed (HF's roundings);
4. counters[t] = c + 1.
The launch has at most one program per SM (`max_programs`), each taking tiles pid, pid + grid, ...:
all of a GPU's programs run at once, so none waits on a peer program that cannot start; a program
sends all its tiles (steps 1-2) before it waits for any (steps 3-4).
A program's tile is its ROWS rows at the layout's row width, whatever the call's row count (the
refill of step 2 covers rows an earlier call of more rows wrote), so one buffer serves one row
width; 16-bit dtypes only (one sentinel pattern for the whole buffer).

Buffer layout per rank: [epoch 0 | epoch 1 | epoch 2], an epoch is WORLD slots of `slot_elems`
16-bit elements (slot `rank` stays unused: a rank's own rows never leave its registers).
`peers` holds every rank's buffer address (int64); on CPU (tests, Triton's interpreter) ordinary
tensors stand in for the peers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.distributed.all_reduce_norm_kernel import add_rms_norm_store, rows_per_program, tile_rows

EPOCHS = 3
SENTINEL = -32768  # int16 bits of -0.0 in bf16 and fp16
_SENTINEL = tl.constexpr(SENTINEL)  # (the kernel's view of it: jitted code reads constexpr globals only)
MAX_TILES = 16384  # a counter each


@triton.jit
def _slot(peers_ptr, owner, epoch_base, writer, slot_elems):
    """Where `writer`'s rows of this epoch start in `owner`'s buffer (int16 elements)."""
    base = tl.multiple_of(tl.load(peers_ptr + owner).to(tl.pointer_type(tl.int16)), 16)
    return base + epoch_base + writer * slot_elems


@triton.jit(do_not_specialize=["num_rows", "rank"])
def _lamport_all_reduce_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, peers_ptr, counters_ptr,
    num_rows, rank, inv_n, eps,
    slot_elems,  # 16-bit elements of one rank's slot in an epoch
    N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, WORLD: tl.constexpr,
):
    dtype = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    num_tiles = tl.cdiv(num_rows, ROWS)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < N
    epoch_elems = slot_elems * WORLD
    sentinel = tl.full((ROWS, BLOCK), _SENTINEL, tl.int16)
    # Phase 1, every tile of this program: send its rows, refill the stale epoch. All sends go out
    # before any wait, so a program's NVLink latency is paid once, not once per tile.
    for t in range(pid, num_tiles, programs):
        count = tl.load(counters_ptr + t)
        tile, mask = tile_rows(t, num_rows, N, BLOCK, ROWS)
        current = (count % 3).to(tl.int64) * epoch_elems
        stale = ((count + 2) % 3).to(tl.int64) * epoch_elems
        bits = tl.load(x_ptr + tile, mask=mask, other=0.0).to(tl.int16, bitcast=True)
        bits = tl.where(bits == _SENTINEL, 0, bits)  # -0.0 -> +0.0: no row value reads as "not arrived"
        for d in tl.static_range(1, WORLD):
            peer = (rank + d) % WORLD
            tl.store(_slot(peers_ptr, peer, current, rank, slot_elems) + tile, bits, mask=mask)
        for d in tl.static_range(1, WORLD):
            writer = (rank + d) % WORLD
            tl.store(_slot(peers_ptr, rank, stale, writer, slot_elems) + tile, sentinel, mask=col_ok[None, :])
    # Phase 2: wait for the peers' rows of each tile, sum in rank order, add, norm.
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    for t in range(pid, num_tiles, programs):
        count = tl.load(counters_ptr + t)
        tile, mask = tile_rows(t, num_rows, N, BLOCK, ROWS)
        rows = (t * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        current = (count % 3).to(tl.int64) * epoch_elems
        bits = tl.load(x_ptr + tile, mask=mask, other=0.0).to(tl.int16, bitcast=True)
        bits = tl.where(bits == _SENTINEL, 0, bits)  # as sent: every rank sums the same numbers
        own = bits.to(dtype, bitcast=True).to(tl.float32)
        total = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for writer in tl.static_range(WORLD):
            is_own = (rows * 0 + writer == rank)[:, None]  # (a tensor: rank is a plain int when interpreted)
            wait = mask & ~is_own
            src = _slot(peers_ptr, rank, current, writer, slot_elems) + tile
            got = tl.load(src, mask=wait, other=0, volatile=True)
            while tl.max(tl.where(wait & (got == _SENTINEL), 1, 0)) > 0:
                got = tl.load(src, mask=wait, other=0, volatile=True)
            total += tl.where(is_own, own, got.to(dtype, bitcast=True).to(tl.float32))
        add_rms_norm_store(total, res_ptr, w, out_ptr, tile, mask, inv_n, eps)
        tl.store(counters_ptr + t, count + 1)


def buffer_bytes(half_bytes: int) -> int:
    """A rank's buffer: three epochs of `half_bytes` (each WORLD slots)."""
    return EPOCHS * half_bytes


def slot_elements(half_bytes: int, world: int) -> int:
    return half_bytes // world // 2


def fits(num_rows: int, n: int, half_bytes: int, world: int) -> bool:
    """Whether every whole tile (ROWS rows, refilled whatever the call's rows) lies in a slot."""
    rows = rows_per_program(n)
    tiles = triton.cdiv(num_rows, rows)
    return tiles <= MAX_TILES and tiles * rows * n <= slot_elements(half_bytes, world)


def max_programs(device: torch.device) -> int:
    """Programs of one launch: at most one per SM, so that all of them run at once whatever order
    the two GPUs schedule them in (a program waits for its peer program's rows; a program queued
    behind waiting ones would never start). On CPU, 2 (the tests' tiles share programs)."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, peers: torch.Tensor,
           counters: torch.Tensor, rank: int, world: int, half_bytes: int, programs: int = 2) -> torch.Tensor:
    """Normed rows in x's dtype (16-bit); `residual` updated in place (float32 or x's dtype). The
    caller checked sizes (`fits`) and that the buffers hold the sentinel where no rows are due."""
    num_rows, n = x.shape
    out = torch.empty_like(x)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(n)
    rows = rows_per_program(n)
    _lamport_all_reduce_add_rms_norm_kernel[(min(triton.cdiv(num_rows, rows), programs),)](
        x, residual, weight, out, peers, counters,
        num_rows, rank, 1.0 / n, eps, slot_elements(half_bytes, world),
        N=n, BLOCK=block, ROWS=rows, WORLD=world,
        num_warps=min(max(block * rows // 256, 1), 16),
    )
    return out
