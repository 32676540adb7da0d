"""Support restriction on temperature-scaled logits: top-k, top-p, min-p.

Each filter sets dropped logits to -inf and always keeps the most likely token.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """top_k: int64 [N] (V = off), top_p: float32 [N] (1.0 = off); either may be None."""
    if top_p is None:
        return logits if top_k is None else _top_k_only(logits, top_k, max_top_k)
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        # The k-th largest sits at V - k; rows with k = V compare against the minimum.
        kth = sorted_logits.gather(1, (logits.shape[1] - top_k)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    # Keep the smallest set of top tokens whose mass reaches top_p: a token is dropped
    # when the mass of itself and every less likely token is <= 1 - top_p.
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1.0 - top_p)[:, None]
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(1, order, sorted_logits)


def _top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    top = logits.topk(max_top_k, dim=-1).values  # descending
    kth = top.gather(1, (top_k.clamp(max=max_top_k) - 1)[:, None])
    # Rows with top_k above every active k have it off.
    kth.masked_fill_(top_k[:, None] > max_top_k, _NEG_INF)
    return logits.masked_fill_(logits < kth, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, _NEG_INF)
