"""Support restriction on temperature-scaled float32 logits: top-k, top-p, min-p.

Each filter sets dropped logits to -inf in place and always keeps the most likely token. Every
filter is a per-row threshold: a token survives when its logit is >= the row's threshold, so tokens
tied at the boundary are kept together. Rows that have a filter off hold a neutral value
(top_k = V or above the step's largest k, top_p = 1.0, min_p = 0.0).
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """top_k: int64 [N]; max_top_k: the largest k in use (< V), known on the host. No sort."""
    top = logits.topk(max_top_k, dim=-1).values  # descending
    kth = top.gather(1, (top_k.clamp(max=max_top_k) - 1)[:, None])
    kth.masked_fill_(top_k[:, None] > max_top_k, _NEG_INF)  # k above every active k: off
    return logits.masked_fill_(logits < kth, _NEG_INF)


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """top-p over the top-k-renormalized distribution; top_k None when no row uses it."""
    sorted_logits = logits.sort(dim=-1).values  # ascending
    vocab_size = logits.shape[1]
    if top_k is not None:
        # The k-th largest sits at V - k; rows with k = V compare against the minimum.
        kth = sorted_logits.gather(1, (vocab_size - top_k.clamp(1, vocab_size))[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    # Drop a token when the mass of itself and every less likely token is <= 1 - top_p: the dropped
    # tokens are a prefix of the ascending order (cumsum only grows); the last one is always kept.
    cum = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    num_dropped = (cum <= (1.0 - top_p)[:, None]).sum(dim=-1, keepdim=True).clamp_(max=vocab_size - 1)
    threshold = sorted_logits.gather(1, num_dropped)
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's, in logit space:
    p / p_max < min_p  <=>  logit < max_logit + log(min_p)  (min_p = 0 -> -inf, keeps all)."""
    threshold = logits.amax(dim=-1, keepdim=True).add_(min_p.log()[:, None])
    return logits.masked_fill_(logits < threshold, _NEG_INF)
