"""One step's model inputs, built from the persistent batch with numpy (no per-token Python).

The general path for any mix of rows (prefill chunks, decodes, several query tokens): the host
lays out the flat token batch, then one host-to-device copy carries every per-token array.
Decode inputs (a position at or past what the host knows) are filled on the device from the
slot's `next_token`. Pure decode steps on CUDA skip all of this (`decode_graphs.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.worker.persistent_batch import PersistentBatch, to_device


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T], device
    positions: torch.Tensor  # int64 [T], device
    meta: AttentionMetadata
    row_slots: torch.Tensor  # int64 [B], device
    sample_rows: np.ndarray  # int64 [S], host: rows that sample a token this step
    logits_indices: torch.Tensor  # int64 [S], device: each sampling row's last token
    sample_slots: torch.Tensor  # int64 [S], device
    num_device_inputs: int  # tokens whose input id came from the device (decode rows)


def build_step_inputs(batch: PersistentBatch, slots: np.ndarray, counts: np.ndarray,
                      block_size: int) -> StepInputs:
    """Rows `slots` compute `counts` more tokens each; advances `batch.num_computed` (host and device)."""
    device = batch.device
    starts = batch.num_computed[slots]
    ends = starts + counts
    known = batch.num_known[slots]
    qsl = np.zeros(len(slots) + 1, dtype=np.int64)
    np.cumsum(counts, out=qsl[1:])
    total = int(qsl[-1])
    row_of_token = np.repeat(np.arange(len(slots)), counts)
    positions = np.arange(total, dtype=np.int64) + (starts - qsl[:-1])[row_of_token]

    input_ids = np.zeros(total, dtype=np.int64)
    for row in np.flatnonzero(starts < known):  # rows with inputs known on the host: prefill chunks
        slot, first, last = slots[row], starts[row], min(ends[row], known[row])
        out = qsl[row]
        input_ids[out:out + last - first] = batch.tokens[slot][first:last]
    from_device = np.flatnonzero(positions >= known[row_of_token])
    token_slots = slots[row_of_token]
    blocks = batch.block_table[token_slots, positions // block_size].astype(np.int64)
    slot_mapping = blocks * block_size + positions % block_size
    sample_rows = np.flatnonzero(ends >= known)
    logits_indices = qsl[1:][sample_rows] - 1

    # One copy for every int64 array, then views. Each view starts 16-byte aligned, as a fresh
    # tensor would: Triton specializes kernels on pointer alignment, and a view whose alignment
    # followed the token count would compile a second variant in the middle of serving.
    parts = [input_ids, positions, slot_mapping, qsl, ends, slots, logits_indices, slots[sample_rows],
             from_device, token_slots[from_device]]
    padded = [len(p) + len(p) % 2 for p in parts]
    offsets = np.cumsum([0] + padded)
    flat = np.zeros(offsets[-1], dtype=np.int64)
    for part, start in zip(parts, offsets):
        flat[start:start + len(part)] = part
    offsets = [(start, start + len(part)) for part, start in zip(parts, offsets)]
    packed = to_device(flat, device)
    (ids_d, pos_d, slot_map_d, qsl_d, seq_lens_d, slots_d, logits_idx_d, sample_slots_d, fill_d,
     fill_slots_d) = (packed[start:end] for start, end in offsets)
    if len(from_device):
        ids_d[fill_d] = batch.next_token_dev[fill_slots_d]
    batch.num_computed[slots] = ends
    batch.num_computed_dev[slots_d] = seq_lens_d

    width = int(-(-ends.max() // block_size))
    meta = AttentionMetadata(
        num_tokens=total, max_query_len=int(counts.max()), max_seq_len=int(ends.max()),
        query_start_loc=qsl_d.to(torch.int32), seq_lens=seq_lens_d.to(torch.int32),
        block_table=batch.block_table_dev[slots_d, :width], slot_mapping=slot_map_d,
        query_start_loc_cpu=torch.from_numpy(qsl.astype(np.int32)),
        seq_lens_cpu=torch.from_numpy(ends.astype(np.int32)))
    return StepInputs(ids_d, pos_d, meta, slots_d, sample_rows, logits_idx_d, sample_slots_d, len(from_device))
