"""Logit adjustments before temperature, in place on float32 [N, V] logits.

Order (the sampler's): logit_bias (added), min_tokens (EOS and stop ids to -inf), repetition
penalty (HF: over prompt and output tokens, logit > 0 -> logit / p, else logit * p), then
frequency and presence penalties (OpenAI: logit -= f * count + pres * (count > 0), over output
tokens only). Rows whose slot does not use an adjustment hold values that leave them unchanged.
"""

from __future__ import annotations

import torch


def add_token_values(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """logits[i, ids[i, j]] += values[i, j]; padding entries add 0.0 (exact)."""
    return logits.scatter_add_(1, ids, values)


def ban_tokens(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """min_tokens: add the rows' -inf entries where `active` (bool [N]), nothing elsewhere."""
    return logits.scatter_add_(1, ids, torch.where(active[:, None], values, 0.0))


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor | None,
                    repetition: torch.Tensor | None, frequency: torch.Tensor | None,
                    presence: torch.Tensor | None) -> torch.Tensor:
    """counts: int32 [N, V] output occurrences; prompt_seen: bool [N, V] (repetition only);
    repetition / frequency / presence: float32 [N], or None when no row uses that penalty."""
    in_output = counts > 0
    if repetition is not None:
        seen = in_output if prompt_seen is None else in_output | prompt_seen
        factor = torch.where(seen, repetition[:, None], 1.0)
        torch.where(logits > 0, logits / factor, logits * factor, out=logits)
    if frequency is not None:
        logits.sub_(frequency[:, None] * counts)
    if presence is not None:
        logits.sub_(presence[:, None] * in_output)
    return logits
