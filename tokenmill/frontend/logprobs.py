"""Packed `Logprobs` rows -> vLLM's per-position `{token_id: Logprob}` dicts."""

from __future__ import annotations

from typing import Any

from tokenmill.outputs import Logprob
from tokenmill.protocol import Logprobs


def logprob_dicts(packed: Logprobs, tokenizer: Any | None) -> list[dict[int, Logprob]]:
    """One dict per row: the chosen token (column 0) with its rank, then the top-k (ranks 1..k).

    With a tokenizer (a `tokenizers.Tokenizer`), each entry's `decoded_token` is its id
    decoded alone, special tokens included (an unfinished character shows as U+FFFD).
    """
    token_ids, logprobs, ranks = packed.arrays()
    ids = token_ids.tolist()
    values = logprobs.tolist()
    chosen_ranks = ranks.tolist()
    text: dict[int, str] = {}
    if tokenizer is not None:
        unique = sorted({i for row in ids for i in row})
        text = dict(zip(unique, tokenizer.decode_batch([[i] for i in unique], skip_special_tokens=False)))
    rows: list[dict[int, Logprob]] = []
    for row_ids, row_values, chosen_rank in zip(ids, values, chosen_ranks):
        row = {row_ids[0]: Logprob(row_values[0], chosen_rank, text.get(row_ids[0]))}
        for rank, (token, value) in enumerate(zip(row_ids[1:], row_values[1:]), start=1):
            if token not in row:
                row[token] = Logprob(value, rank, text.get(token))
        rows.append(row)
    return rows
