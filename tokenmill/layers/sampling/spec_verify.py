"""Verification of drafts against the target's own samples (placeholder until the full module lands)."""

from __future__ import annotations

import torch


def accept_matching(sampled: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """sampled int64 [R, K+1], drafts int64 [R, K], num_drafts int64 [R] -> (emitted [R, K+1], num_emitted [R])."""
    k = drafts.shape[1]
    cols = torch.arange(k, device=sampled.device)[None, :]
    match = (sampled[:, :k] == drafts) & (cols < num_drafts[:, None])
    accepted = match.to(torch.int64).cumprod(1).sum(1)
    num_emitted = accepted + 1
    keep = torch.arange(k + 1, device=sampled.device)[None, :] < num_emitted[:, None]
    return torch.where(keep, sampled, -1), num_emitted
