"""One step's model inputs, built from the persistent batch with numpy (no per-token Python).

The general path for any mix of rows (prefill chunks, decodes, several query tokens): the host
lays out the flat token batch, then one host-to-device copy carries every per-token array.
Decode inputs (a position at or past what the host knows) are filled on the device from the
slot's `next_token`. Pure decode steps on CUDA skip all of this (`decode_graphs.py`).

With speculative decoding a decode row scheduled for 1 + k tokens feeds its next token and then
its slot's k drafts, and how many tokens the previous step accepted is known only on the device:
so a decode row's positions, KV slots and context length come from the device's computed-token
count (the host's is only an upper bound for such rows), and every position of a row with
drafts is sampled (logits for each).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.worker.persistent_batch import PersistentBatch, to_device_aligned


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
    sample_drafts: np.ndarray | None = None  # int64 [S], host: drafts each sampling row verifies (speculation)
    sample_seq_lens: torch.Tensor | None = None  # int64 [S], device: context length after the step


def build_step_inputs(batch: PersistentBatch, slots: np.ndarray, counts: np.ndarray,
                      block_size: int, drafts: torch.Tensor | None = None) -> StepInputs:
    """Rows `slots` compute `counts` more tokens each; advances `batch.num_computed` (host and device).
    `drafts` (int64 [slots, K], device): speculation is on, and decode rows with more than one
    token verify that many - 1 of their slot's drafts."""
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
    # (Under speculation a decode row's host positions may run past its table: they are redone on the device.)
    columns = np.minimum(positions // block_size, batch.block_table.shape[1] - 1)
    blocks = batch.block_table[token_slots, columns].astype(np.int64)
    slot_mapping = blocks * block_size + positions % block_size
    sample_rows = np.flatnonzero(ends >= known)
    sample_drafts = None
    if drafts is None:
        logits_indices = qsl[1:][sample_rows] - 1
    else:
        sample_drafts = np.where(starts[sample_rows] >= known[sample_rows], counts[sample_rows] - 1, 0)
        per_row = sample_drafts + 1  # logits of every position of a row with drafts
        first = qsl[1:][sample_rows] - per_row
        logits_indices = np.repeat(first - (np.cumsum(per_row) - per_row), per_row) + np.arange(per_row.sum())
    within_row = np.arange(total, dtype=np.int64) - qsl[:-1][row_of_token]

    # One copy for every int64 array, then views.
    parts = [input_ids, positions, slot_mapping, qsl, ends, slots, logits_indices, slots[sample_rows],
             from_device, token_slots[from_device], within_row[from_device], sample_rows,
             np.flatnonzero(starts >= known), batch.num_prompt[slots]]
    (ids_d, pos_d, slot_map_d, qsl_d, seq_lens_d, slots_d, logits_idx_d, sample_slots_d, fill_d,
     fill_slots_d, fill_j_d, sample_rows_d, decode_rows, prompt_lens_d) = to_device_aligned(parts, device)
    seq_lens_cpu = torch.from_numpy(ends.astype(np.int32))
    if drafts is not None and len(from_device):
        ids_d[fill_d] = torch.where(fill_j_d == 0, batch.next_token_dev[fill_slots_d],
                                    drafts[fill_slots_d, (fill_j_d - 1).clamp_min(0)])
        fill_pos = batch.num_computed_dev[fill_slots_d] + fill_j_d
        pos_d[fill_d] = fill_pos
        fill_blocks = batch.block_table_dev[fill_slots_d, fill_pos // block_size].to(torch.int64)
        slot_map_d[fill_d] = fill_blocks * block_size + fill_pos % block_size
        seq_lens_d[decode_rows] = batch.num_computed_dev[slots_d[decode_rows]] + (
            qsl_d[decode_rows + 1] - qsl_d[decode_rows])
        if device.type == "cpu":  # exact host lengths cost nothing here (the torch backend reads them)
            seq_lens_cpu = seq_lens_d.to(torch.int32)
    elif len(from_device):
        ids_d[fill_d] = batch.next_token_dev[fill_slots_d]
    batch.num_computed[slots] = ends
    batch.num_computed_dev[slots_d] = seq_lens_d

    width = int(-(-ends.max() // block_size))
    meta = AttentionMetadata(
        num_tokens=total, max_query_len=int(counts.max()), max_seq_len=int(ends.max()),
        query_start_loc=qsl_d.to(torch.int32), seq_lens=seq_lens_d.to(torch.int32),
        block_table=batch.block_table_dev[slots_d, :width], slot_mapping=slot_map_d,
        query_start_loc_cpu=torch.from_numpy(qsl.astype(np.int32)), seq_lens_cpu=seq_lens_cpu,
        seq_lens_exact=drafts is None or device.type == "cpu", prompt_lens=prompt_lens_d)
    return StepInputs(ids_d, pos_d, meta, slots_d, sample_rows, logits_idx_d, sample_slots_d, len(from_device),
                      sample_drafts, seq_lens_d[sample_rows_d])
