"""Flat attention metadata for one step: every attention backend reads only this.

A step's tokens are packed into one flat batch: sequence i owns query tokens
`query_start_loc[i]:query_start_loc[i+1]`, which are the last tokens of its
context of `seq_lens[i]` tokens (earlier ones are already in the KV cache).
Prefill chunks and decodes mix freely; a decode is just a query of length 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    num_tokens: int  # real (unpadded) tokens in the step
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1], on the device
    seq_lens: torch.Tensor  # int32 [num_seqs], context length after this step, on the device
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], on the device
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset; -1 = padding, not written
    query_start_loc_cpu: torch.Tensor  # int32 [num_seqs + 1], on the host
    seq_lens_cpu: torch.Tensor  # int32 [num_seqs], on the host (an upper bound unless seq_lens_exact)
    # False under speculative decoding on CUDA: the device's seq_lens are exact, the host's an
    # upper bound (a decode row's accepted drafts are known only on the device).
    seq_lens_exact: bool = True
    # int [num_seqs], on the device: each sequence's full prompt length (LongRoPE picks a prompt's
    # factors by it, however the prompt is chunked: layers/rotary.py); None: seq_lens stand in.
    prompt_lens: torch.Tensor | None = None
    # What a backend derives from this step's metadata, computed by the first layer and reused by
    # the others (every layer of a step sees this same object).
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens_cpu.shape[0]
