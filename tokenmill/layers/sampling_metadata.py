"""Per-step sampling inputs: host-side request state turned into device tensors once.

Superseded by tokenmill.layers.sampling (per-slot state on the device); kept until the model
runner moves to it, then deleted with penalties.py, sampling_filters.py and logprobs.py.

Every optional tensor is None when no row in the step needs it, so the sampler
skips that work entirely (an all-greedy batch carries nothing but argmax).
All host-to-device copies happen here, before the sampler runs.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain
from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.sampling_params import SamplingParams


class SamplingRow(Protocol):
    """What the worker holds per request."""

    params: SamplingParams
    generator: torch.Generator | None  # set iff params.seed is not None; seeded once, on the device
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated so far


@dataclass(frozen=True)
class SparseLogits:
    """(row, token) pairs to update in a [N, V] logits tensor."""

    rows: torch.Tensor  # int64 [M]
    tokens: torch.Tensor  # int64 [M]
    values: torch.Tensor | None  # float32 [M]; None where the update is a fixed value


@dataclass(frozen=True)
class PenaltyTensors:
    repetition: torch.Tensor | None  # float32 [N], 1.0 = off; None when every row is off
    frequency: torch.Tensor | None  # float32 [N]
    presence: torch.Tensor | None  # float32 [N]
    prompt_mask: torch.Tensor | None  # bool [N, V]: token in the prompt (repetition rows only)
    output_counts: torch.Tensor  # float32 [N, V]: occurrences in the output so far


@dataclass(frozen=True)
class SamplingMetadata:
    num_rows: int
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None  # float32 [N], 1.0 on greedy rows; None when all greedy
    greedy: torch.Tensor | None  # bool [N]; None unless greedy and random rows mix
    top_k: torch.Tensor | None  # int64 [N] in [1, V]; V where off; None when no random row uses it
    max_top_k: int  # largest top_k in use (< V), 0 when top_k is None
    top_p: torch.Tensor | None  # float32 [N], 1.0 where off
    min_p: torch.Tensor | None  # float32 [N], 0.0 where off
    generators: tuple[tuple[int, torch.Generator], ...]  # (row, generator) of seeded random rows
    logit_bias: SparseLogits | None
    min_tokens_mask: SparseLogits | None  # (row, token) pairs forced to -inf
    penalties: PenaltyTensors | None
    max_num_logprobs: int | None  # None when no row asked for logprobs


def build_sampling_metadata(rows: Sequence[SamplingRow], vocab_size: int, eos_token_ids: Sequence[int],
                            device: torch.device) -> SamplingMetadata:
    params = [r.params for r in rows]
    greedy = [p.greedy for p in params]
    all_greedy, all_random = all(greedy), not any(greedy)
    random_rows = [p for p, g in zip(params, greedy) if not g]

    temperature = greedy_t = top_k = top_p = min_p = None
    max_top_k = 0
    if not all_greedy:
        temperature = _tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                              torch.float32, device)
        if not all_random:
            greedy_t = _tensor(greedy, torch.bool, device)
        ks = [_effective_top_k(p, g, vocab_size) for p, g in zip(params, greedy)]
        if any(k < vocab_size for k in ks):
            top_k = _tensor(ks, torch.int64, device)
            max_top_k = max(k for k in ks if k < vocab_size)
        if any(p.top_p < 1.0 for p in random_rows):
            top_p = _tensor([1.0 if g else p.top_p for p, g in zip(params, greedy)], torch.float32, device)
        if any(p.min_p > 0.0 for p in random_rows):
            min_p = _tensor([0.0 if g else p.min_p for p, g in zip(params, greedy)], torch.float32, device)

    generators = tuple((i, r.generator) for i, (r, g) in enumerate(zip(rows, greedy))
                       if not g and r.generator is not None)
    requested = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        num_rows=len(rows), all_greedy=all_greedy, all_random=all_random, temperature=temperature,
        greedy=greedy_t, top_k=top_k, max_top_k=max_top_k, top_p=top_p, min_p=min_p, generators=generators,
        logit_bias=_logit_bias(params, vocab_size, device),
        min_tokens_mask=_min_tokens_mask(rows, vocab_size, eos_token_ids, device),
        penalties=_penalties(rows, vocab_size, device),
        max_num_logprobs=max(requested) if requested else None)


def _effective_top_k(p: SamplingParams, greedy: bool, vocab_size: int) -> int:
    if greedy or p.top_k <= 0:
        return vocab_size
    return min(p.top_k, vocab_size)


def _logit_bias(params: list[SamplingParams], vocab_size: int, device: torch.device) -> SparseLogits | None:
    entries = [(i, t, b) for i, p in enumerate(params) if p.logit_bias
               for t, b in p.logit_bias.items() if 0 <= t < vocab_size]
    if not entries:
        return None
    rows, tokens, values = zip(*entries)
    return SparseLogits(_tensor(rows, torch.int64, device), _tensor(tokens, torch.int64, device),
                        _tensor(values, torch.float32, device))


def _min_tokens_mask(rows: Sequence[SamplingRow], vocab_size: int, eos_token_ids: Sequence[int],
                     device: torch.device) -> SparseLogits | None:
    pairs: list[tuple[int, int]] = []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) < r.params.min_tokens:
            banned = set(eos_token_ids) | set(r.params.stop_token_ids or ())
            pairs.extend((i, t) for t in sorted(banned) if 0 <= t < vocab_size)
    if not pairs:
        return None
    row_ids, tokens = zip(*pairs)
    return SparseLogits(_tensor(row_ids, torch.int64, device), _tensor(tokens, torch.int64, device), None)


def _penalties(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> PenaltyTensors | None:
    params = [r.params for r in rows]
    use_rep = any(p.repetition_penalty != 1.0 for p in params)
    use_freq = any(p.frequency_penalty != 0.0 for p in params)
    use_pres = any(p.presence_penalty != 0.0 for p in params)
    if not (use_rep or use_freq or use_pres):
        return None
    # Only rows that use a penalty contribute tokens; the others get empty lists.
    active = [p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
              for p in params]
    outputs = [r.output_token_ids if a else [] for r, a in zip(rows, active)]
    counts = _token_histogram(outputs, vocab_size, device)
    prompt_mask = None
    if use_rep:
        prompts = [r.prompt_token_ids if p.repetition_penalty != 1.0 else [] for r, p in zip(rows, params)]
        prompt_mask = _token_histogram(prompts, vocab_size, device) > 0
    return PenaltyTensors(
        repetition=_tensor([p.repetition_penalty for p in params], torch.float32, device) if use_rep else None,
        frequency=_tensor([p.frequency_penalty for p in params], torch.float32, device) if use_freq else None,
        presence=_tensor([p.presence_penalty for p in params], torch.float32, device) if use_pres else None,
        prompt_mask=prompt_mask, output_counts=counts)


def _token_histogram(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """float32 [N, V]: how often each token occurs in each row's list."""
    counts = torch.zeros(len(token_lists) * vocab_size, dtype=torch.float32, device=device)
    # One flat index row * V + token per occurrence, built without per-token Python work.
    flat = array("q", chain.from_iterable(token_lists))
    if flat:
        lengths = torch.tensor([len(t) for t in token_lists])
        offsets = torch.arange(len(token_lists)).mul_(vocab_size).repeat_interleave(lengths)
        index = _host_to_device(torch.frombuffer(flat, dtype=torch.int64).add(offsets), device)
        counts.index_add_(0, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    return counts.view(len(token_lists), vocab_size)


def _tensor(data: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _host_to_device(torch.tensor(data, dtype=dtype), device)


def _host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Pinned staging lets the copy run asynchronously, without waiting on the device.
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
