"""Where each logits row of a step finds its grammar mask (structured outputs).

The engine core sends a step's masks deduplicated (`GrammarBitmask`: the distinct masks, and per
masked (row, position) which of them); the device applies them per logits row. This maps the one to
the other for the three logits layouts a step can have: one row per sampling row; a row verifying
k drafts as k + 1 rows packed one after the other; or a graph's padded layout, `query_len` rows per
sampling row.
"""

from __future__ import annotations

import numpy as np

from tokenmill.protocol import GrammarBitmask


def mask_entries(vocab_size: int, mask: GrammarBitmask | None, sample_rows: np.ndarray,
                 drafts: np.ndarray | None, query_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct masks int32 [D, words], each logits row's mask among them or -1)."""
    words = -(-vocab_size // 32)
    per_row = np.ones(len(sample_rows), np.int64) if drafts is None else drafts + 1
    num_logits = len(sample_rows) * query_len if query_len is not None else int(per_row.sum())
    which_of_row = np.full(num_logits, -1, np.int32)
    if mask is None or not mask.rows:
        return np.zeros((0, words), np.int32), which_of_row
    rows, which, bits = mask.arrays()
    positions = mask.position_array()
    index = np.searchsorted(sample_rows, rows)
    assert (index < len(sample_rows)).all() and (sample_rows[index] == rows).all(), "a mask row that samples not"
    assert (positions < per_row[index]).all(), "a mask for a position the row does not sample"
    if query_len is not None:
        index = index * query_len + positions
    elif drafts is not None:
        index = (np.cumsum(per_row) - per_row)[index] + positions
    which_of_row[index] = which
    return bits, which_of_row
