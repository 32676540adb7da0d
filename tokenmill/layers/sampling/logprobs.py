"""Logprobs of the sampled tokens and the top-k alternatives, from the raw logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogprobsResult:
    """Per row, on the device: the sampled token's logprob and rank, and the step's top-k.

    k is the largest `logprobs` among the active slots; a row that asked for fewer keeps a prefix
    of its top-k columns (sorted, best first). Rows that asked for none carry values too: ignore them.
    """

    sampled_logprobs: torch.Tensor  # float32 [N]
    sampled_ranks: torch.Tensor  # int64 [N]: 1 + number of tokens with a strictly larger logprob
    topk_token_ids: torch.Tensor  # int64 [N, k]
    topk_logprobs: torch.Tensor  # float32 [N, k]


def compute_logprobs(raw_logits: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsResult:
    """raw_logits: [N, V] before any bias, penalty or temperature; sampled: int64 [N]."""
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    sampled_lp = logprobs.gather(1, sampled[:, None])
    ranks = (logprobs > sampled_lp).sum(dim=-1).add_(1)
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
    else:
        top_ids = torch.empty(raw_logits.shape[0], 0, dtype=torch.int64, device=raw_logits.device)
        top_lp = torch.empty(raw_logits.shape[0], 0, dtype=torch.float32, device=raw_logits.device)
    return LogprobsResult(sampled_logprobs=sampled_lp.squeeze(1), sampled_ranks=ranks,
                          topk_token_ids=top_ids, topk_logprobs=top_lp)
