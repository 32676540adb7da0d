"""The sampler: one step's logits [N, V] to one token id per row.

Superseded by tokenmill.layers.sampling (per-slot state on the device); kept until the model
runner moves to it, then deleted with penalties.py, sampling_filters.py and logprobs.py.

Pipeline: raw logits -> (logprobs, from the raw logits) -> bias, min_tokens,
penalties -> greedy argmax | temperature, top-k, top-p, min-p, random draw.

Random rows sample by an exponential race, argmax(probs / E) with E ~ Exp(1)
i.i.d. per token, which picks token t with probability probs[t]. A seeded row
draws its E from its own generator, exactly V values per step, so its tokens
do not depend on what else is in the batch; unseeded rows share one draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.logprobs import LogprobsResult, compute_logprobs
from tokenmill.layers.penalties import apply_logit_adjustments
from tokenmill.layers.sampling_filters import apply_min_p, apply_top_k_top_p
from tokenmill.layers.sampling_metadata import SamplingMetadata, SamplingRow, build_sampling_metadata

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "SamplingRow", "build_sampling_metadata"]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [N]
    logprobs: LogprobsResult | None  # set when any row asked for logprobs


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if (meta.all_greedy and meta.max_num_logprobs is None and meta.logit_bias is None
                and meta.min_tokens_mask is None and meta.penalties is None):
            # Plain greedy: argmax of the raw logits, no float32 copy (the order is the same).
            return SamplerOutput(sampled_token_ids=logits.argmax(dim=-1), logprobs=None)
        raw = logits
        # Float32 copy: the caller's logits stay untouched, and the raw ones feed logprobs.
        logits = logits.to(torch.float32, copy=True)
        logits = apply_logit_adjustments(logits, meta)
        if meta.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            greedy = None if meta.all_random else logits.argmax(dim=-1)
            sampled = self._sample_random(logits, meta)
            if greedy is not None:
                sampled = torch.where(meta.greedy, greedy, sampled)
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = compute_logprobs(raw, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        assert meta.temperature is not None
        logits.div_(meta.temperature[:, None])
        logits = apply_top_k_top_p(logits, meta.top_k, meta.max_top_k, meta.top_p)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        if len(meta.generators) < meta.num_rows:
            noise.exponential_()
        for row, generator in meta.generators:
            noise[row].exponential_(generator=generator)
        # E = 0 would turn a zero-probability token into 0/0.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return probs.div_(noise).argmax(dim=-1)
