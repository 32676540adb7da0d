"""N-gram prompt lookup on the device: drafts from the request's own tokens, no host sync.

For each row: take the last n tokens of its history (n from `max_n` down to `min_n`), find
their latest earlier occurrence within the last `window` tokens, and propose the k tokens that
followed it. Rows with no match propose a repeat of their last token (verification makes any
draft safe; the scheduler's acceptance estimate makes useless ones rare).

All rows at once: the history windows are compared with torch ops ([S, window, n] per n),
so the cost does not depend on how many rows match, and nothing waits for the host.
"""

from __future__ import annotations

import torch


@torch.inference_mode()
def propose_ngram(history: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, k: int,
                  min_n: int, max_n: int, window: int = 1024) -> torch.Tensor:
    """`history` int32/int64 [slots, width] (each slot's tokens), `lengths` int64 [slots],
    `slots` int64 [S]. Returns int64 [S, k] drafts."""
    num_rows = slots.shape[0]
    device = history.device
    width = min(window, history.shape[1])
    lengths = lengths.index_select(0, slots)
    # The last `width` positions of each row (negative positions: before the row's start).
    positions = lengths[:, None] - width + torch.arange(width, device=device)[None, :]
    inside = positions >= 0
    tokens = history[slots[:, None], positions.clamp_min(0)].to(torch.int64)
    tokens = torch.where(inside, tokens, -1)
    starts = torch.arange(width, device=device)
    best = torch.full((num_rows,), -1, dtype=torch.int64, device=device)  # continuation start, window coords
    for n in range(max_n, min_n - 1, -1):
        if n >= width:
            continue
        suffix = tokens[:, width - n:]  # [S, n]
        windows = tokens.unfold(1, n, 1)  # [S, width - n + 1, n]; window i covers i .. i+n-1
        match = (windows == suffix[:, None, :]).all(-1) & (suffix[:, :1] >= 0)
        match &= starts[None, :width - n + 1] + n < width  # a continuation exists (not the suffix itself)
        latest = torch.where(match, starts[None, :width - n + 1], -1).amax(-1)
        found = (latest >= 0) & (best < 0)
        best = torch.where(found, latest + n, best)
    last = tokens[:, -1:]
    take = best[:, None] + torch.arange(k, device=device)[None, :]
    valid = (best[:, None] >= 0) & (take < width)
    drafts = torch.gather(tokens, 1, take.clamp(0, width - 1))
    # Past the continuation's end, or with no match: repeat the last token.
    return torch.where(valid, drafts, last).clamp_min(0)
