"""One adapter's LoRA inside the base GEMM: its expand as extra K columns of that GEMM.

For a step whose tokens with an adapter all use one slot s, a projection's output
`y = x @ W^T + sum_i (x @ A_s,i^T) @ B_s,i^T` (part i: q, k, v or gate, up) is one GEMM over
`[x | t]` and `[W | B_s]`, t = x @ A_s^T (zeros for tokens without an adapter) and B_s laid out
block-diagonally by part (part i's output rows take columns K + i * R .. K + (i + 1) * R).

- The projection's weight lives in a wider buffer `ext` [N, K + E] (`attach`); the layer's weight
  is its view [:, :K] (rows of stride K + E), so every other path (cuBLAS, the one-row GEMV) runs
  on it as before. The last E columns hold one slot's B (`load_slot`, on the host before a step,
  only when the slot changes); E is the parts' ranks rounded up to `EXT_ALIGN`, zeros past them.
- `concat_shrink` writes x and t into one [T, K + E] buffer in one kernel (it reads x once: the
  copy and the shrink share the read), and the GEMM runs on that: no delta is written, read
  back or added, and there is no expand kernel.

The shrink's K is split over programs when the step has few row tiles (a decode step); the last
program of a row tile to finish (an atomic counter per tile) sums the K slices' float32 partial
sums in a fixed order: the same result on every run.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

EXT_ALIGN = 64  # E rounded up to this (cuBLAS's K tiles: K + E stays a multiple of 64 for K = 4096)
_BLOCK_K = 128
_MAX_SPLITS = 8
_PROGRAMS_PER_SM = 2


@triton.jit(do_not_specialize=["T", "SPLITS"])
def _concat_shrink_kernel(x_ptr, a_ptr, xe_ptr, slots_ptr, part_ptr, count_ptr, T, K, E, E_OUT, K_PER_SPLIT, SPLITS,
                          stride_xt, stride_as, stride_an, stride_et, stride_ps, stride_pt,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, IEEE: tl.constexpr):
    """Program (row tile, K slice): copies x's slice into xe[:, :K] and, for the tile's one slot,
    the slice's x @ A^T (A: E rows); the tile's t (summed over slices) goes to xe[:, K:K + E_OUT],
    zeros for tokens without an adapter and past E."""
    dtype = xe_ptr.dtype.element_ty
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < T
    m64 = m.to(tl.int64)
    row_slots = tl.load(slots_ptr + m, mask=m_ok, other=-1)
    s = tl.max(row_slots, axis=0).to(tl.int64)  # the tile's slot (one slot a step on this path; -1: none)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    acc = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ok = m_ok[:, None] & (k < K)[None, :]
        xb = tl.load(x_ptr + m64[:, None] * stride_xt + k[None, :], mask=ok, other=0.0)
        tl.store(xe_ptr + m64[:, None] * stride_et + k[None, :], xb, mask=ok)
        if s >= 0:
            ab = tl.load(a_ptr + s * stride_as + e[None, :].to(tl.int64) * stride_an + k[:, None],
                         mask=e_ok[None, :] & (k < K)[:, None], other=0.0)
            if IEEE:  # float32 inputs: exact float32 products, not TF32
                acc += tl.dot(xb, ab, input_precision="ieee")
            else:
                acc += tl.dot(xb, ab)
    live = (row_slots >= 0)[:, None]
    t_ptrs = xe_ptr + m64[:, None] * stride_et + K + e[None, :]
    t_ok = m_ok[:, None] & (e < E_OUT)[None, :]
    if SPLITS == 1:
        tl.store(t_ptrs, tl.where(live, acc, 0.0).to(dtype), mask=t_ok)
    else:
        p_ptrs = part_ptr + m64[:, None] * stride_pt + e[None, :]
        tl.store(p_ptrs + pid_k * stride_ps, acc, mask=t_ok)
        tl.debug_barrier()  # every thread's partial sums stored before the counter is bumped
        done = tl.atomic_add(count_ptr + pid_m, 1, sem="acq_rel")
        if done == SPLITS - 1:  # the tile's last slice: sum every slice's partial sums, in order
            total = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
            for split in range(0, SPLITS):
                total += tl.load(p_ptrs + split * stride_ps, mask=t_ok, other=0.0, cache_modifier=".cg")
            tl.store(t_ptrs, tl.where(live, total, 0.0).to(dtype), mask=t_ok)
            tl.atomic_xchg(count_ptr + pid_m, 0)  # (ready for the next launch: graph replays included)


def ext_columns(parts: int, rank: int) -> int:
    """E: the extra K columns of a projection of `parts` parts of rank `rank`."""
    return triton.cdiv(parts * rank, EXT_ALIGN) * EXT_ALIGN


def tile_rows(num_tokens: int) -> int:
    return 16 if num_tokens <= 512 else 64


@functools.cache
def _launch(num_tokens: int, k: int, sm_count: int) -> tuple[int, int, int, int]:
    """(row tiles, splits, K per split, BLOCK_M) of a step of `num_tokens` tokens."""
    block_m = tile_rows(num_tokens)
    tiles = triton.cdiv(num_tokens, block_m)
    splits = max(1, min(_PROGRAMS_PER_SM * sm_count // tiles, triton.cdiv(k, _BLOCK_K), _MAX_SPLITS))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), _BLOCK_K) * _BLOCK_K
    return tiles, triton.cdiv(k, k_per_split), k_per_split, block_m


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


class ConcatWorkspace:
    """What the split shrinks of a step share: float32 partial sums and the per-tile counters
    (zeros between launches: each launch's last programs reset theirs)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.partials = torch.empty(0, dtype=torch.float32, device=device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)
        self._kept: list[torch.Tensor] = []  # outgrown buffers: graphs captured on them still use them

    def get(self, numel: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Grown outside graph capture only (a captured body's eager run before its capture grows
        them): a capture must find them large enough."""
        grow = self.partials.numel() < numel or self.counters.numel() < tiles
        if grow and self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("concat_shrink: workspace too small inside a graph capture (run the body eagerly first)")
        if self.partials.numel() < numel:
            self._kept.append(self.partials)
            self.partials = torch.empty(numel, dtype=torch.float32, device=self.device)
        if self.counters.numel() < tiles:
            self._kept.append(self.counters)
            self.counters = torch.zeros(tiles, dtype=torch.int32, device=self.device)
        return self.partials, self.counters

    def reserve(self, num_tokens: int, k: int, e: int) -> None:
        tiles, splits, _, _ = _launch(num_tokens, k, _sm_count(self.device))
        if splits > 1:
            self.get(splits * num_tokens * e, tiles)


def concat_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, e: int,
                  workspace: ConcatWorkspace) -> torch.Tensor:
    """[x | t] as one new [T, K + e] tensor: t = x[t] @ A[slot]^T for tokens with an adapter (every
    one of the same slot), zeros for the others and past A's rows (`a`: [slots, parts * R, K])."""
    num_tokens, k = x.shape
    assert x.stride(1) == 1 and a.stride(2) == 1 and a.shape[1] <= e and a.shape[2] == k
    xe = torch.empty(num_tokens, k + e, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return xe
    tiles, splits, k_per_split, block_m = _launch(num_tokens, k, _sm_count(x.device))
    slots = token_slots if token_slots.dtype == torch.int32 and token_slots.stride(0) == 1 \
        else token_slots.to(torch.int32).contiguous()
    partials, counters = workspace.get(splits * num_tokens * e if splits > 1 else 0, tiles if splits > 1 else 0)
    if splits > 1:
        partials = partials[:splits * num_tokens * e].view(splits, num_tokens, e)
    else:
        partials, counters = xe, slots  # (unused)
    _concat_shrink_kernel[(tiles, splits)](
        x, a, xe, slots, partials, counters, num_tokens, k, a.shape[1], e, k_per_split, splits,
        x.stride(0), a.stride(0), a.stride(1), xe.stride(0), partials.stride(0) if splits > 1 else 0,
        partials.stride(1) if splits > 1 else 0, BLOCK_M=block_m, BLOCK_K=_BLOCK_K,
        BLOCK_E=max(16, triton.next_power_of_2(e)), IEEE=x.dtype == torch.float32,
        num_warps=4)
    return xe


def concat_shrink_reference(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, e: int) -> torch.Tensor:
    """`concat_shrink` in torch (float32 products, rounded to x's dtype)."""
    s = token_slots.clamp_min(0).long()
    t = torch.einsum("tk,trk->tr", x.float(), a[s].float()) * (token_slots >= 0)[:, None]
    pad = torch.zeros(x.shape[0], e - a.shape[1], dtype=torch.float32, device=x.device)
    return torch.cat([x, torch.cat([t, pad], dim=1).to(x.dtype)], dim=1)
