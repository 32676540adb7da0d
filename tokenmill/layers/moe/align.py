"""Token-expert pairs sorted by expert and padded to the GEMM's BLOCK_M, on the device.

Pair p = token * k + slot (p < T * k). Expert e's pairs occupy rows [start(e), start(e) +
count(e)) of the sorted order, and start(e) is count(0..e-1) rounded up block by block, so
every BLOCK_M rows belong to one expert. Padding rows hold the sentinel T * k. Sizes come from
the shapes alone (at most T * k + min(E, T * k) * (BLOCK_M - 1) rows): counts and offsets
never leave the device, no host sync, so the whole MoE layer runs inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Alignment:
    sorted_pairs: torch.Tensor  # int32 [max_rows]: the pair at each padded row (sentinel T * k: padding)
    block_expert: torch.Tensor  # int32 [max_blocks]: each block's expert (E: past the end, skipped)
    max_blocks: int


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """At most min(E, pairs) experts hold pairs, each padded by at most BLOCK_M - 1 rows (at batch 1
    the grid is then k blocks, not E)."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


TRITON_MAX_PAIRS = 4096  # one program walks the pairs: beyond this the torch ops' parallel sort wins
IMPL = "auto"  # "auto", "torch" or "triton" (A/B measurements, tests)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """ids [T, k] (expert of each pair) -> the padded sorted layout."""
    use_triton = IMPL == "triton" or (IMPL == "auto" and ids.is_cuda and ids.numel() <= TRITON_MAX_PAIRS)
    if use_triton:
        from tokenmill.layers.moe.triton_align import align_by_expert_triton
        return align_by_expert_triton(ids, num_experts, block_m)
    return align_by_expert_torch(ids, num_experts, block_m)


def align_by_expert_torch(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    flat = ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    max_blocks = -(-max_rows // block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(num_pairs, device=flat.device) - start[sorted_experts]
    dest = padded_start[sorted_experts] + rank
    sorted_pairs = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(max_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return Alignment(sorted_pairs, block_expert, max_blocks)
