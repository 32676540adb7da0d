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

import dataclasses
import os

import torch
import triton
import triton.language as tl

from tokenmill.distributed.all_reduce_norm_kernel import (add_rms_norm_store, add_rms_norm_store_loaded,
                                                          rows_per_program, tile_rows)

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
    USE_PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,  # the residual's tile loaded before the wait for the peers' rows
):
    dtype = x_ptr.dtype.element_ty
    # PDL (as `layers/triton_ops/pdl.py`): the launch may come before the kernel ahead has finished; this
    # kernel touches nothing before that kernel's writes are visible (its counters, buffers and rows
    # are all written by earlier kernels of the stream).
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
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
    if USE_PDL:  # (the next kernel waits for this whole grid before it reads)
        tl.extra.cuda.gdc_launch_dependents()
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
        if PREFETCH:  # (its latency under the peers' NVLink trip; only this kernel writes it meanwhile)
            residual = tl.load(res_ptr + tile, mask=mask, other=0.0)
        total = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for writer in tl.static_range(WORLD):
            is_own = (rows * 0 + writer == rank)[:, None]  # (a tensor: rank is a plain int when interpreted)
            wait = mask & ~is_own
            src = _slot(peers_ptr, rank, current, writer, slot_elems) + tile
            got = tl.load(src, mask=wait, other=0, volatile=True)
            while tl.max(tl.where(wait & (got == _SENTINEL), 1, 0)) > 0:
                got = tl.load(src, mask=wait, other=0, volatile=True)
            total += tl.where(is_own, own, got.to(dtype, bitcast=True).to(tl.float32))
        if PREFETCH:
            add_rms_norm_store_loaded(residual, total, res_ptr, w, out_ptr, tile, mask, inv_n, eps)
        else:
            add_rms_norm_store(total, res_ptr, w, out_ptr, tile, mask, inv_n, eps)
        tl.store(counters_ptr + t, count + 1)


def buffer_bytes(half_bytes: int) -> int:
    """A rank's buffer: three epochs of `half_bytes` (each WORLD slots)."""
    return EPOCHS * half_bytes


def slot_elements(half_bytes: int, world: int) -> int:
    return half_bytes // world // 2


@dataclasses.dataclass(frozen=True)
class LamportTiles:
    """How a launch cuts the rows: `rows` per tile, `warps` per program, and up to `per_sm` programs
    per SM (more than one only where the compiled kernel's registers let that many stay resident
    at once: `programs`); `pdl`: launched with programmatic dependent launch where the device has
    it (`layers/triton_ops/pdl.py`; TOKENMILL_PDL=0 still turns it off); `prefetch`: the residual's
    tile loaded before the wait for the peers' rows. None: the default for the row width
    (`tiles_for`)."""

    rows: int
    warps: int
    per_sm: int = 1
    pdl: bool = False
    prefetch: bool = False

    @staticmethod
    def parse(text: str) -> LamportTiles:
        """"rows:warps[:per_sm[:flags]]", flags "pdl", "pre" or "pdl+pre": e.g. "2:16:2" or
        "1:16:1:pdl+pre" (TOKENMILL_LAMPORT_TILES, `bench all-reduce --lamport-tiles`)."""
        fields = text.split(":")
        flags = set(fields[3].split("+")) if len(fields) == 4 else set()
        try:
            if len(fields) > 4 or not flags <= {"pdl", "pre"}:
                raise ValueError
            tiles = LamportTiles(*[int(v) for v in fields[:3]], pdl="pdl" in flags, prefetch="pre" in flags)
        except (TypeError, ValueError):
            raise ValueError(f"lamport tiles {text!r}: expected rows:warps[:per_sm[:pdl+pre]], e.g. 2:16:1") from None
        if not (1 <= tiles.rows <= 64 and tiles.rows & (tiles.rows - 1) == 0 and tiles.warps in (1, 2, 4, 8, 16, 32)
                and 1 <= tiles.per_sm <= 8):
            raise ValueError(f"lamport tiles {text!r}: rows a power of two in 1..64, warps in 1..32 (a power "
                             "of two), per_sm in 1..8")
        return tiles


def tiles_for(n: int) -> LamportTiles:
    """TOKENMILL_LAMPORT_TILES where set, else the rows that make a tile of 2048 elements (one row
    at hidden 4096) with a warp per 512 of them (at most 16), up to three programs per SM (as many
    as the compiled kernel fits: 3 at hidden 4096 on sm_90), launched with PDL. On two H100s
    (`gpu_layouts.py --parts arsweep`, bf16, hidden 4096, in CUDA graphs, both checked) that took
    41.9 us at 1024 rows and 3.4 us at one row, against 54.5 and 3.7 us for the first shape (a warp
    per 256 elements, one program per SM, no PDL; TOKENMILL_LAMPORT_TILES=1:16:1)."""
    text = os.environ.get("TOKENMILL_LAMPORT_TILES", "")
    if text:
        return LamportTiles.parse(text)
    rows = rows_per_program(n)
    return LamportTiles(rows, min(max(triton.next_power_of_2(n) * rows // 512, 1), 16), 3, pdl=True)


def fits(num_rows: int, n: int, half_bytes: int, world: int, tiles: LamportTiles | None = None) -> bool:
    """Whether every whole tile (its rows, refilled whatever the call's rows) lies in a slot."""
    rows = (tiles or tiles_for(n)).rows
    tiles_needed = triton.cdiv(num_rows, rows)
    return tiles_needed <= MAX_TILES and tiles_needed * rows * n <= slot_elements(half_bytes, world)


def resident_per_sm(kernel, warps: int, device: torch.device) -> int:
    """How many programs of the compiled `kernel` one SM holds at once (registers, shared memory,
    threads), at least 1."""
    regs = int(getattr(kernel, "n_regs", 0) or 0)
    if regs <= 0:  # not known: one, always safe
        return 1
    props = torch.cuda.get_device_properties(device)
    threads = warps * 32
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (((regs * 32 + 255) // 256) * 256 * warps)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    shared = int(getattr(kernel, "metadata", None) and getattr(kernel.metadata, "shared", 0) or 0)
    by_shared = (getattr(props, "shared_memory_per_multiprocessor", 228 << 10) // shared) if shared else 32
    return max(min(by_regs, by_threads, by_shared, 32), 1)


def max_programs(device: torch.device) -> int:
    """Programs of one launch: at most one per SM, so that all of them run at once whatever order
    the two GPUs schedule them in (a program waits for its peer program's rows; a program queued
    behind waiting ones would never start). On CPU, 2 (the tests' tiles share programs)."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pdl_kwargs(device: torch.device) -> dict:
    """PDL's launch keywords where the device has it (9.0+) and TOKENMILL_PDL is not 0 (as
    `layers/triton_ops/pdl.py`, which this layer may not import)."""
    if device.type != "cuda" or os.environ.get("TOKENMILL_PDL", "1").lower() in ("0", "false", "no"):
        return {}
    if torch.cuda.get_device_capability(device) < (9, 0):
        return {}
    return {"USE_PDL": True, "launch_pdl": True}


_RESIDENT: dict[tuple, int] = {}  # (device, N, tiles) -> programs per SM the compiled kernel allows


def programs(device: torch.device, n: int, tiles: LamportTiles, sms: int) -> int:
    """Programs of a launch: `sms` (one per SM, always resident together) times `tiles.per_sm`
    where the compiled kernel fits that many per SM, known after its first launch (which takes one
    per SM). Every program must be resident at once: each waits for its peer program's rows, and a
    program queued behind waiting ones would never start."""
    if tiles.per_sm == 1 or device.type != "cuda":
        return sms
    known = _RESIDENT.get((device.index, n, tiles))
    return sms * min(tiles.per_sm, known) if known else sms


def launch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, peers: torch.Tensor,
           counters: torch.Tensor, rank: int, world: int, half_bytes: int, programs_: int = 2,
           tiles: LamportTiles | None = None) -> torch.Tensor:
    """Normed rows in x's dtype (16-bit); `residual` updated in place (float32 or x's dtype). The
    caller checked sizes (`fits`, with the same `tiles`) and that the buffers hold the sentinel where
    no rows are due. `programs_`: one per SM (`max_programs`); `tiles.per_sm` may multiply it."""
    num_rows, n = x.shape
    out = torch.empty_like(x)
    if num_rows == 0:
        return out
    tiles = tiles or tiles_for(n)
    block = triton.next_power_of_2(n)
    grid = min(triton.cdiv(num_rows, tiles.rows), programs(x.device, n, tiles, programs_))
    kernel = _lamport_all_reduce_add_rms_norm_kernel[(grid,)](
        x, residual, weight, out, peers, counters,
        num_rows, rank, 1.0 / n, eps, slot_elements(half_bytes, world),
        N=n, BLOCK=block, ROWS=tiles.rows, WORLD=world, PREFETCH=tiles.prefetch,
        num_warps=tiles.warps, **(_pdl_kwargs(x.device) if tiles.pdl else {}),
    )
    if tiles.per_sm > 1 and x.device.type == "cuda" and (x.device.index, n, tiles) not in _RESIDENT:
        _RESIDENT[(x.device.index, n, tiles)] = resident_per_sm(kernel, tiles.warps, x.device)
    return out
