"""`align.align_by_expert` in one Triton launch (CUDA decode batches; the torch version takes about
twenty small kernels, which at a few tokens cost more than the experts' GEMMs).

One program does it all, in three passes over the T * k pairs (CHUNK pairs at a time):
1. each pair's rank among the pairs of its expert (earlier chunks' counts plus an exclusive
   cumulative sum of the chunk's one-hot [E, CHUNK] matrix along the pairs: stable, as the torch
   sort is), kept in a scratch row, and the experts' counts;
2. the padded starts (counts rounded up to BLOCK_M, cumulative), each block's expert (how many
   padded ends are <= its first row: `searchsorted(..., right=True)`, E past the last expert),
   and the sentinel T * k in every row;
3. (after a barrier, so the sentinel stores land first) each pair to row padded_start(e) + rank.
The result is the torch version's, element for element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.moe.align import Alignment, max_padded_rows

ONE_HOT_ELEMENTS = 8192  # CHUNK * E_PAD per pass step: the [CHUNK, E] one-hot tile held in registers


@triton.jit(do_not_specialize=["num_pairs", "max_rows", "max_blocks"])
def _align_kernel(ids_ptr, sorted_pairs_ptr, block_expert_ptr, scratch_ptr, num_pairs, max_rows, max_blocks,
                  NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  FILL: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):  # 1. ranks within each expert, and the counts
        pair = start + offs
        valid = pair < num_pairs
        expert = tl.load(ids_ptr + pair, mask=valid, other=E_PAD).to(tl.int32)
        # [E, CHUNK]: the pairs run along the fastest axis, so the scan stays within a warp.
        hot = (experts[:, None] == expert[None, :]).to(tl.int32)
        before = tl.cumsum(hot, axis=1) - hot + counts[:, None]
        rank = tl.sum(before * hot, axis=0)
        tl.store(scratch_ptr + pair, rank, mask=valid)
        counts += tl.sum(hot, axis=1)
    # 2. padded starts, the blocks' experts, the sentinel everywhere
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    tl.store(scratch_ptr + num_pairs + experts, padded_end - padded)
    real = experts < NUM_EXPERTS
    for b0 in range(0, max_blocks, CHUNK):
        block = b0 + offs
        ended = (padded_end[None, :] <= (block * BLOCK_M)[:, None]) & real[None, :]
        tl.store(block_expert_ptr + block, tl.sum(ended.to(tl.int32), axis=1), mask=block < max_blocks)
    sentinel = tl.full([FILL], 0, dtype=tl.int32) + num_pairs
    for r0 in range(0, max_rows, FILL):
        row = r0 + tl.arange(0, FILL)
        tl.store(sorted_pairs_ptr + row, sentinel, mask=row < max_rows)
    tl.debug_barrier()
    for start in range(0, num_pairs, FILL):  # 3. each pair to its row
        pair = start + tl.arange(0, FILL)
        valid = pair < num_pairs
        expert = tl.load(ids_ptr + pair, mask=valid, other=0).to(tl.int32)
        row = tl.load(scratch_ptr + num_pairs + expert, mask=valid, other=0) + tl.load(scratch_ptr + pair, mask=valid,
                                                                                      other=0)
        tl.store(sorted_pairs_ptr + row, pair, mask=valid)


def align_by_expert_triton(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """`align.align_by_expert`'s result in one launch (ids [T, k] on a Triton device)."""
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_pairs = flat.numel()
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    max_blocks = -(-max_rows // block_m)
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(16, min(ONE_HOT_ELEMENTS // e_pad, triton.next_power_of_2(max(num_pairs, 1))))
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=flat.device)
    scratch = torch.empty(num_pairs + e_pad, dtype=torch.int32, device=flat.device)
    _align_kernel[(1,)](flat, sorted_pairs, block_expert, scratch, num_pairs, max_blocks * block_m, max_blocks,
                        NUM_EXPERTS=num_experts, E_PAD=e_pad, BLOCK_M=block_m, CHUNK=chunk, FILL=1024,
                        num_warps=8)
    return Alignment(sorted_pairs, block_expert, max_blocks)
