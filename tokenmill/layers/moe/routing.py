"""Router logits -> each token's top-k experts and their weights, as each family's config says.

The one rule (`MoEArch`): scores = softmax or sigmoid of the logits in float32; with groups,
experts outside the best `topk_groups` groups are masked; the top-k by score (plus the
correction bias, DeepSeek-V3, which only chooses and never weighs); weights are the chosen
scores, renormalized to sum to 1 where asked, times `routed_scaling_factor`. Everything is a
fixed-shape torch op: no host syncs, capturable in CUDA graphs.
"""

from __future__ import annotations

import torch

from tokenmill.config import MoEArch


def select_experts(logits: torch.Tensor, moe: MoEArch,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k])."""
    logits = logits.float()
    scores = logits.sigmoid() if moe.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if moe.num_groups > 1:
        choice = _mask_groups(choice, moe)
    ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False).indices
    return _weights_of(scores, ids, moe), ids


def expert_weights(logits: torch.Tensor, moe: MoEArch, ids: torch.Tensor) -> torch.Tensor:
    """float32 [T, k]: the weights `select_experts` gives experts `ids` [T, k] (chosen by any rule,
    e.g. another run's choice imposed by a diagnostic) from `logits` [T, E]."""
    logits = logits.float()
    scores = logits.sigmoid() if moe.scoring == "sigmoid" else logits.softmax(dim=-1)
    return _weights_of(scores, ids, moe)


def _weights_of(scores: torch.Tensor, ids: torch.Tensor, moe: MoEArch) -> torch.Tensor:
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights


def fused_router_applies(moe: MoEArch) -> bool:
    """Whether `triton_router` (one launch on CUDA) covers this rule: no groups, no correction bias."""
    return moe.num_groups == 1 and not moe.score_correction_bias and moe.scoring in ("softmax", "sigmoid")


def _mask_groups(choice: torch.Tensor, moe: MoEArch) -> torch.Tensor:
    """Experts outside each token's best `topk_groups` groups get -inf (never chosen)."""
    t, e = choice.shape
    grouped = choice.view(t, moe.num_groups, e // moe.num_groups)
    if moe.group_score == "top2_sum":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    best = torch.topk(group_scores, moe.topk_groups, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, e)
