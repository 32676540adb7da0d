"""Drives a model step by step over a paged KV cache, as the model runner would, for tests."""

from __future__ import annotations

import torch

from tokenmill.layers.attention.backend import kv_cache_shape
from tokenmill.layers.attention.metadata import AttentionMetadata


def make_metadata(context_lens: list[int], query_lens: list[int], block_table: torch.Tensor,
                  block_size: int) -> AttentionMetadata:
    """Sequence i computes its last `query_lens[i]` tokens of `context_lens[i]` (after the step)."""
    qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens = torch.tensor(context_lens, dtype=torch.int32)
    slots = []
    for i, (ctx, q) in enumerate(zip(context_lens, query_lens)):
        for pos in range(ctx - q, ctx):
            slots.append(int(block_table[i, pos // block_size]) * block_size + pos % block_size)
    return AttentionMetadata(
        num_tokens=sum(query_lens), max_query_len=max(query_lens), max_seq_len=max(context_lens),
        query_start_loc=qsl, seq_lens=seq_lens, block_table=block_table.to(torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=seq_lens.clone())


class PagedRunner:
    """Runs prompts through `model` batched together: one prefill step, then greedy decode steps.

    Each sequence gets a shuffled, non-contiguous set of cache blocks, so paging bugs show.
    """

    def __init__(self, model: torch.nn.Module, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_seqs: int, max_len: int, block_size: int = 16, seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        blocks_per_seq = -(-max_len // block_size)
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(num_seqs * blocks_per_seq, generator=gen)
        self.block_table = perm.view(num_seqs, blocks_per_seq)
        shape = kv_cache_shape(num_seqs * blocks_per_seq, block_size, num_kv_heads, head_dim)
        self.kv_caches = [torch.zeros(shape) for _ in range(num_layers)]

    @torch.no_grad()
    def step(self, tokens: list[list[int]], context_lens: list[int]) -> torch.Tensor:
        """Computes `tokens[i]` as the last tokens of sequence i; returns logits [sum(len), vocab]."""
        query_lens = [len(t) for t in tokens]
        ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long)
        positions = torch.tensor([p for ctx, q in zip(context_lens, query_lens) for p in range(ctx - q, ctx)])
        meta = make_metadata(context_lens, query_lens, self.block_table, self.block_size)
        hidden = self.model(ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    def generate_greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        lens = [len(p) for p in prompts]
        logits = self.step(prompts, lens)
        last_rows = torch.tensor(lens).cumsum(0) - 1
        out = [[t] for t in logits[last_rows].argmax(-1).tolist()]
        for _ in range(max_new_tokens - 1):
            lens = [n + 1 for n in lens]
            logits = self.step([[seq[-1]] for seq in out], lens)
            for seq, t in zip(out, logits.argmax(-1).tolist()):
                seq.append(t)
        return out
