"""Logit adjustments applied before temperature: bias, min_tokens, penalties.

Order: logit_bias (added), min_tokens (EOS and stop ids to -inf), repetition
penalty (HF definition), then frequency and presence penalties (OpenAI
definitions). Everything works in place on float32 [N, V] logits.
"""

from __future__ import annotations

import torch

from tokenmill.layers.sampling_metadata import PenaltyTensors, SamplingMetadata


def apply_logit_adjustments(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.logit_bias is not None:
        bias = meta.logit_bias
        logits.index_put_((bias.rows, bias.tokens), bias.values, accumulate=True)
    if meta.min_tokens_mask is not None:
        mask = meta.min_tokens_mask
        logits[mask.rows, mask.tokens] = float("-inf")
    if meta.penalties is not None:
        apply_penalties(logits, meta.penalties)
    return logits


def apply_penalties(logits: torch.Tensor, pen: PenaltyTensors) -> torch.Tensor:
    counts = pen.output_counts
    if pen.repetition is not None:
        # For tokens seen in the prompt or output: logit > 0 -> logit / p, else logit * p.
        seen = counts > 0
        if pen.prompt_mask is not None:
            seen |= pen.prompt_mask
        factor = torch.where(seen, pen.repetition[:, None], 1.0)
        logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))
    if pen.frequency is not None:
        logits.sub_(pen.frequency[:, None] * counts)
    if pen.presence is not None:
        logits.sub_(pen.presence[:, None] * (counts > 0))
    return logits
