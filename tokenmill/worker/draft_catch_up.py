"""The draft model's KV for positions the target computed while the draft slept (see "Dormant
proposer state" in core/spec_policy.py): a prefill of the draft over each row's tokens from
position 0, in forward passes of at most `budget` tokens (a long row in several chunks, each
attending to the ones before it), eagerly. Only the draft's KV changes."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.worker.persistent_batch import PersistentBatch, to_device_aligned

Piece = tuple[int, int, np.ndarray]  # (slot, first position, the tokens from there)


def plan_passes(rows: list[tuple[int, np.ndarray]], budget: int) -> list[list[Piece]]:
    """Each row's tokens (slot, tokens from position 0) cut into pieces, packed in order into
    passes of at most `budget` tokens."""
    passes: list[list[Piece]] = [[]]
    room = budget
    for slot, tokens in rows:
        first = 0
        while first < len(tokens):
            if room == 0:
                passes.append([])
                room = budget
            take = min(room, len(tokens) - first)
            passes[-1].append((slot, first, tokens[first:first + take]))
            first += take
            room -= take
    return [p for p in passes if p]


@torch.inference_mode()
def catch_up(model: torch.nn.Module, kv_caches: list[torch.Tensor], batch: PersistentBatch,
             rows: list[tuple[int, np.ndarray]], block_size: int, budget: int) -> None:
    """Run `model` (the draft) over `rows` (slot, its tokens from position 0) into `kv_caches`,
    through the slots' block tables (already on the device)."""
    for pieces in plan_passes([(slot, tokens) for slot, tokens in rows if len(tokens)], budget):
        slots = np.array([slot for slot, _, _ in pieces], dtype=np.int64)
        firsts = np.array([first for _, first, _ in pieces], dtype=np.int64)
        counts = np.array([len(tokens) for _, _, tokens in pieces], dtype=np.int64)
        ends = firsts + counts
        qsl = np.concatenate([[0], np.cumsum(counts)])
        row_of_token = np.repeat(np.arange(len(pieces)), counts)
        positions = np.arange(qsl[-1], dtype=np.int64) + (firsts - qsl[:-1])[row_of_token]
        blocks = batch.block_table[slots[row_of_token], positions // block_size].astype(np.int64)
        input_ids = np.concatenate([tokens for _, _, tokens in pieces]).astype(np.int64)
        parts = [input_ids, positions, blocks * block_size + positions % block_size, qsl, ends, slots]
        ids_d, pos_d, slot_map_d, qsl_d, ends_d, slots_d = to_device_aligned(parts, batch.device)
        width = int(-(-ends.max() // block_size))
        meta = AttentionMetadata(
            num_tokens=int(qsl[-1]), max_query_len=int(counts.max()), max_seq_len=int(ends.max()),
            query_start_loc=qsl_d.to(torch.int32), seq_lens=ends_d.to(torch.int32),
            block_table=batch.block_table_dev[slots_d, :width], slot_mapping=slot_map_d,
            query_start_loc_cpu=torch.from_numpy(qsl.astype(np.int32)),
            seq_lens_cpu=torch.from_numpy(ends.astype(np.int32)))
        model(ids_d, pos_d, kv_caches, meta)
