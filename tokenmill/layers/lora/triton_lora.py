"""Batched LoRA in Triton: the step's plan and every launch shape (what the kernels modules
share), two shapes of work.

- **rows** (decode sizes, up to `ROWS_MAX_TOKENS` tokens): a program owns one token, a block of
  columns and (in the shrink) one slice of K; it reads its token's slot and does a vector-matrix product with
  vectorised loads (no tensor-core tile of 16 rows for one token). Tokens without an adapter
  (slot -1) return at once. The shrink's K slices give the parallelism a single token lacks.
- **tiles** (larger steps): the step's tokens sorted by slot are cut into tiles of BLOCK_M rows
  that never cross a slot boundary (`plan_tiles`, once per step, on the device); a program owns
  one tile and one block of columns and does tensor-core dots with its slot's A or B block. Each
  adapter's weights are read once per tile, never for a slot absent from the tile.

The shrink writes float32 partial sums [splits, T, parts * R] (K split over programs, no
atomics: the same result on every run) into the step's workspace; the expand adds the planes
once per tile and adds its delta into y in place (the base projection's output). Grids, splits
and block sizes depend on shapes only (capture-safe), and are computed once per shape
(`ShrinkConfig`, cached), not per call.

The modules (one job each): this one, the plan and the launch shapes, with every tunable (the
kernels modules read them here at each call, so a knob set on this module takes effect);
`triton_shrink` (x @ A^T), `triton_expand` (y += t @ B^T), `triton_fused` (the decode path's
fusions: the expand with SiLU-and-mul, and the next projection's shrink), `triton_concat` (one
slot's LoRA inside the base GEMM).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_BIG = 1 << 30  # "no more parts" on the host
ROWS_MAX_TOKENS = 16  # steps up to this many tokens use the per-token (rows) kernels
_ROWS_BLOCK_K = 128
_ROWS_MAX_SPLITS = 64  # the rows expand loads this many planes of a token in one (masked) block
_TILES_BLOCK_K = 64
_TILES_MAX_SPLITS = 8


# ---------------------------------------------------------------- per step: the plan

# BLOCK_M of the tile kernels for steps of up to 512 tokens (larger ones: 64). A knob: a step's
# one adapter would take fewer, larger tiles; many adapters of a few tokens each, smaller ones.
TILE_ROWS_SMALL = 16


def tile_rows(num_tokens: int) -> int:
    """BLOCK_M of the tiles kernels for a step of `num_tokens` tokens."""
    return TILE_ROWS_SMALL if num_tokens <= 512 else 64


def max_tiles(num_tokens: int, num_slots: int) -> int:
    """An upper bound on a step's tiles: every tile has a token; each group of tokens (a slot's,
    and the tokens without an adapter) adds at most one partial tile."""
    return min(num_tokens, triton.cdiv(num_tokens, tile_rows(num_tokens)) + num_slots + 1)


NO_TILE = -2  # a tile table entry past the step's tiles (-1: a tile of tokens without an adapter)


def plan_tiles(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's tiles, on the device without a host sync: `order` (int32 [T], token indices sorted
    by slot, -1 first), `tiles` (int32 [3, max_tiles]: each tile's slot (-1: tokens without an
    adapter, which only the fused activation reads; NO_TILE: none), first and end position in
    `order`) and `count` (int32 [1]: the real tiles, which come first). Each group's tokens are cut
    into ceil(count / BLOCK_M) tiles, the groups in order."""
    num_tokens, device = token_slots.shape[0], token_slots.device
    block_m, limit = tile_rows(num_tokens), max_tiles(num_tokens, num_slots)
    sorted_slots, order = torch.sort(token_slots.to(torch.int32), stable=True)
    groups = torch.arange(-1, num_slots, dtype=torch.int32, device=device)
    starts = torch.searchsorted(sorted_slots, groups)
    ends = torch.searchsorted(sorted_slots, groups, right=True)
    per_group = (ends - starts + block_m - 1) // block_m
    tile_end = per_group.cumsum(0)
    tile = torch.arange(limit, dtype=torch.int64, device=device)
    group = torch.searchsorted(tile_end, tile, right=True)
    real = group <= num_slots
    group = group.clamp_max(num_slots)
    first = starts[group] + (tile - (tile_end[group] - per_group[group])) * block_m
    tiles = torch.stack([torch.where(real, group - 1, NO_TILE), first, torch.minimum(first + block_m, ends[group])])
    return order.to(torch.int32), tiles.to(torch.int32), tile_end[-1:].to(torch.int32)


@triton.jit(do_not_specialize=["T", "MAX_TILES", "GROUPS"])
def _plan_tiles_kernel(slots_ptr, order_ptr, tiles_ptr, count_ptr, T, MAX_TILES, GROUPS,
                       BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, NO_TILE_: tl.constexpr):
    """`plan_tiles` in one program (one launch instead of a sort and a dozen small ops): a
    counting sort of the tokens by group (slot + 1; stable), then the tile table."""
    g = tl.arange(0, BLOCK_G)
    counts = tl.zeros((BLOCK_G,), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        grp = tl.load(slots_ptr + t, mask=t < T, other=-2).to(tl.int32) + 1
        counts += tl.sum((grp[:, None] == g[None, :]).to(tl.int32), axis=0)
    starts = tl.cumsum(counts, axis=0) - counts
    per_group = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(per_group, axis=0)
    total = tl.sum(per_group, axis=0)
    running = starts
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        grp = tl.load(slots_ptr + t, mask=t < T, other=-2).to(tl.int32) + 1
        hot = (grp[:, None] == g[None, :]).to(tl.int32)
        rank = tl.cumsum(hot, axis=0) - hot  # earlier tokens of the same group in this block
        pos = tl.sum(hot * (running[None, :] + rank), axis=1)
        tl.store(order_ptr + pos, t, mask=t < T)
        running += tl.sum(hot, axis=0)
    for i0 in range(0, MAX_TILES, BLOCK_T):
        i = i0 + tl.arange(0, BLOCK_T)
        valid_g = g < GROUPS
        grp = tl.sum(((tile_end[None, :] <= i[:, None]) & valid_g[None, :]).to(tl.int32), axis=1)
        grp = tl.minimum(grp, GROUPS - 1)
        hot = (grp[:, None] == g[None, :]).to(tl.int32)
        start = tl.sum(hot * starts[None, :], axis=1)
        first_tile = tl.sum(hot * (tile_end - per_group)[None, :], axis=1)
        end = start + tl.sum(hot * counts[None, :], axis=1)
        first = start + (i - first_tile) * BLOCK_M
        real = i < total
        ok = i < MAX_TILES
        tl.store(tiles_ptr + i, tl.where(real, grp - 1, NO_TILE_), mask=ok)
        tl.store(tiles_ptr + MAX_TILES + i, first, mask=ok)
        tl.store(tiles_ptr + 2 * MAX_TILES + i, tl.minimum(first + BLOCK_M, end), mask=ok)
    tl.store(count_ptr, total)


def plan_tiles_fused(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`plan_tiles`' result (the same order, tiles and count) from one kernel."""
    num_tokens, device = token_slots.shape[0], token_slots.device
    limit = max_tiles(num_tokens, num_slots)
    order = torch.empty(num_tokens, dtype=torch.int32, device=device)
    tiles = torch.empty(3, limit, dtype=torch.int32, device=device)
    count = torch.empty(1, dtype=torch.int32, device=device)
    slots = token_slots if token_slots.stride(0) == 1 else token_slots.contiguous()
    _plan_tiles_kernel[(1,)](slots, order, tiles, count, num_tokens, limit, num_slots + 1,
                             BLOCK_M=tile_rows(num_tokens), BLOCK_T=64,
                             BLOCK_G=max(16, triton.next_power_of_2(num_slots + 1)), NO_TILE_=NO_TILE,
                             num_warps=4)
    return order, tiles, count


# Steps of up to this many tokens get their tile plan from `_plan_tiles_kernel` (one launch; its
# one program is slower than the torch ops' sort beyond), larger ones from `plan_tiles`.
PLAN_KERNEL_MAX_TOKENS = 1024


# The tile kernels' grid: GRID_M programs along the tiles, each looping over tiles i, i + GRID_M,
# ... up to the step's real count (read on the device). None: GRID_M = the worst-case bound
# (`max_tiles`, one tile a program at most). A factor f: about f * ceil(T / BLOCK_M) programs
# (no empty programs for one adapter; but a program then runs several tiles in a row when the
# step mixes adapters: on an H200, 256 tokens of 64 adapters took 388 us a layer at f = 1 and
# 307 at the bound, one adapter the same either way; gpu_lora.py --parts layer).
TILE_GRID_FACTOR: float | None = None
# The shrink splits K until about this many programs per SM run; more splits cost more in the
# expand, which sums the planes (H200: 4 per SM and 16 splits, or 8 and 32, were slower).
TILE_PROGRAMS_PER_SM = 2
# The tile expands sum the shrink's K-split planes in a loop; unrolled (loads back to back) it was
# slower on an H200 (gpu_lora layer, 256 tokens: 272 vs 247 us a layer with 1 adapter, 375 vs 312
# with 64; the unrolled loop of a constexpr split count), so it stays rolled by default.
TILE_SPLITS_UNROLL = False
SILU_TILE_BLOCK_N = 64  # columns of gate (and of up) per program of the fused activation's tiles
EXPAND_TILE_BLOCK_N = 128  # the widest column block of the expand's tiles (it must divide the parts)
# ... in steps of small tiles (up to 512 tokens): wider (H200, 32 layers at 256 tokens: 243.4 vs
# 247.2 us a layer with 1 adapter, 288.6 vs 294.4 with 64; at 8192 tokens 256 was slower).
EXPAND_TILE_BLOCK_N_SMALL = 256


def _splits_max(splits: int) -> int:
    """The unrolled split loop's length: the tile shrink's most splits (a knob), so one compile
    serves every step size."""
    return max(splits, _TILES_MAX_SPLITS)


def tile_grid(num_tokens: int, num_slots: int, factor: float | None | str = "default") -> int:
    factor = TILE_GRID_FACTOR if factor == "default" else factor
    bound = max_tiles(num_tokens, num_slots)
    if factor is None:
        return bound
    fewest = triton.cdiv(num_tokens, tile_rows(num_tokens))
    return max(1, min(bound, int(fewest * factor + 0.999)))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@dataclass(frozen=True)
class ShrinkConfig:
    """A shrink's launch for one shape: grid, K split and blocks; `planes`: the workspace it fills."""
    rows: bool  # the per-token kernels (else the tiles kernels)
    grid: tuple[int, int, int]
    splits: int
    k_per_split: int
    block_n: int
    block_k: int
    block_m: int

    def planes_numel(self, num_tokens: int, n: int) -> int:
        return self.splits * num_tokens * n


def shrink_config(num_tokens: int, n: int, k: int, num_slots: int, sm_count: int, rows: bool) -> ShrinkConfig:
    return _shrink_config(num_tokens, n, k, num_slots, sm_count, rows, TILE_GRID_FACTOR, TILE_PROGRAMS_PER_SM,
                          _TILES_MAX_SPLITS, tile_rows(num_tokens))


@functools.cache
def _shrink_config(num_tokens: int, n: int, k: int, num_slots: int, sm_count: int, rows: bool, grid_factor: float,
                   per_sm: int, tiles_max_splits: int, tile_block_m: int) -> ShrinkConfig:
    """K is split so that a few programs per SM run (a decode step has few tokens)."""
    if rows:
        block_n = min(64, triton.next_power_of_2(n))
        block_k, block_m, max_splits = _ROWS_BLOCK_K, 1, _ROWS_MAX_SPLITS
        lead, programs = num_tokens, num_tokens * triton.cdiv(n, block_n)
        per_sm = 2
    else:
        block_n = 16 if n <= 16 else (32 if n <= 32 else 64)
        block_k, block_m, max_splits = _TILES_BLOCK_K, tile_block_m, tiles_max_splits
        lead = tile_grid(num_tokens, num_slots, grid_factor)
        programs = triton.cdiv(num_tokens, block_m) * triton.cdiv(n, block_n)  # the fewest real tiles
    splits = max(1, min(per_sm * sm_count // programs, triton.cdiv(k, block_k), max_splits))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    return ShrinkConfig(rows, (lead, triton.cdiv(n, block_n), splits), splits, k_per_split, block_n, block_k, block_m)


def _tile_warps(block_m: int, block_n: int) -> int:
    """Warps of a tile kernel holding float32 [block_m, block_n] values (few registers per thread)."""
    return 8 if block_m * block_n >= 8192 else 4


def expand_block_n(part_starts: tuple[int, ...], widest: int = 64) -> int:
    """The widest BLOCK_N (16..`widest`) dividing every part boundary; 0 when none does."""
    block = widest
    while block >= 16:
        if all(p % block == 0 for p in part_starts[:-1]):
            return block
        block //= 2
    return 0


@dataclass
class StepPlan:
    """What every LoRA projection of one step shares: the token -> slot map in the form its
    kernels read, and one float32 workspace for the shrink's planes (reused by every projection:
    each expand consumes its shrink's planes before the next projection's shrink runs)."""
    num_tokens: int
    num_slots: int
    token_slots: torch.Tensor  # int32 [T] (rows kernels)
    order: torch.Tensor | None  # int32 [T] (tiles kernels)
    tiles: torch.Tensor | None  # int32 [3, max_tiles] (tiles kernels)
    workspace: torch.Tensor  # float32, at least every projection's planes
    count: torch.Tensor | None = None  # int32 [1]: the step's real tiles (tiles kernels)
    grid_m: int = 0  # the tile kernels' programs along the tiles (`tile_grid`)
    # rows kernels: the planes of a shrink fused into the previous kernel (`lora_expand_silu`), apart
    # from `workspace` (read by that same kernel)
    next_workspace: torch.Tensor | None = None


def plan_step(token_slots: torch.Tensor, num_slots: int, shapes: set[tuple[int, int]],
              rows_max: int = ROWS_MAX_TOKENS) -> StepPlan:
    """`shapes`: every LoRA projection's (parts * R, in_features): the workspace fits the largest.
    Steps of up to `rows_max` tokens run the per-token kernels, larger ones the tile kernels."""
    num_tokens, device = token_slots.shape[0], token_slots.device
    sms, rows = _sm_count(device), num_tokens <= rows_max
    numel = max((shrink_config(num_tokens, n, k, num_slots, sms, rows).planes_numel(num_tokens, n)
                 for n, k in shapes), default=0)
    workspace = torch.empty(max(numel, 1), dtype=torch.float32, device=device)
    if rows:  # the rows kernels index token_slots by token: a dense int32 copy when not one already
        # (a one-row prompt chunk's slots are an expanded view with stride 0: read past its element)
        widest = max((n for n, _ in shapes), default=1)
        fused = torch.empty(_ROWS_MAX_SPLITS * num_tokens * widest, dtype=torch.float32, device=device)
        return StepPlan(num_tokens, num_slots, token_slots.to(torch.int32).contiguous(), None, None, workspace,
                        next_workspace=fused)
    planner = plan_tiles_fused if num_tokens <= PLAN_KERNEL_MAX_TOKENS else plan_tiles
    order, tiles, count = planner(token_slots, num_slots)
    return StepPlan(num_tokens, num_slots, token_slots, order, tiles, workspace, count,
                    tile_grid(num_tokens, num_slots))
