"""Speculative-decoding test helpers: a toy model whose logits are a fixed function of the tokens a
step has emitted so far, the sampling filters written out from their definitions (float64), one
speculative step driven as the worker drives it, and the chi-square test of the emitted tokens."""

from __future__ import annotations

import itertools

import torch
from scipy.stats import chi2

from tests.helpers.sampling import Harness
from tokenmill.layers.sampling.seeded_noise import NoiseStream
from tokenmill.layers.sampling.spec_layout import flat_rows, flat_to_padded
from tokenmill.layers.sampling.spec_verify import rejection_sample, verify_drafts
from tokenmill.sampling_params import SamplingParams


class PrefixModel:
    """Logits (float64 [V]) for every prefix of up to `depth` tokens: a random table, one row each."""

    def __init__(self, vocab: int, depth: int, seed: int, scale: float = 1.5) -> None:
        self.vocab = vocab
        self.level_start = [sum(vocab ** i for i in range(level)) for level in range(depth + 2)]
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(self.level_start[-1], vocab, generator=g, dtype=torch.float64) * scale

    def perturbed(self, scale: float, seed: int) -> PrefixModel:
        """A 'draft model': the same table plus noise."""
        other = PrefixModel.__new__(PrefixModel)
        other.vocab, other.level_start = self.vocab, self.level_start
        g = torch.Generator().manual_seed(seed)
        other.table = self.table + torch.randn(self.table.shape, generator=g, dtype=torch.float64) * scale
        return other

    def rounded(self, dtype: torch.dtype) -> PrefixModel:
        """The same model with logits exactly representable in `dtype` (bfloat16 on the device)."""
        other = PrefixModel.__new__(PrefixModel)
        other.vocab, other.level_start = self.vocab, self.level_start
        other.table = self.table.to(dtype).double()
        return other

    def codes(self, prefixes: torch.Tensor) -> torch.Tensor:
        """int64 [N]: the table row of each prefix (int64 [N, L])."""
        code = torch.zeros(prefixes.shape[0], dtype=torch.int64)
        for i in range(prefixes.shape[1]):
            code = code * self.vocab + prefixes[:, i]
        return code + self.level_start[prefixes.shape[1]]

    def logits(self, prefixes: torch.Tensor) -> torch.Tensor:
        return self.table[self.codes(prefixes.cpu())]

    def logits_along(self, tokens: torch.Tensor) -> torch.Tensor:
        """float64 [N, L + 1, V]: the logits after each prefix tokens[:, :j], j = 0..L."""
        return torch.stack([self.logits(tokens[:, :j]) for j in range(tokens.shape[1] + 1)], dim=1)


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float64 [N, V]: the sampling distribution from its definitions (no bias / penalties here)."""
    logits = logits.double()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    z = logits / params.temperature
    vocab = z.shape[-1]
    if 0 < params.top_k < vocab:  # keep the k largest
        z = z.masked_fill(z < z.topk(params.top_k, dim=-1).values[:, -1:], -torch.inf)
    if params.top_p < 1.0:  # keep a token while the mass strictly above it is below top_p
        p = z.softmax(-1)
        above = (p[:, None, :] > p[:, :, None]).double().mul(p[:, None, :]).sum(-1)
        z = z.masked_fill(above >= params.top_p, -torch.inf)
    p = z.softmax(-1)
    if params.min_p > 0.0:
        z = z.masked_fill(p < params.min_p * p.amax(-1, keepdim=True), -torch.inf)
    return z.softmax(-1)


def chain_probabilities(target: PrefixModel, params: SamplingParams, length: int) -> torch.Tensor:
    """float64 [V ** length]: the target's law of `length` tokens, cell = the tokens in base V."""
    vocab = target.vocab
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=length)), dtype=torch.int64)
    prob = torch.ones(len(seqs), dtype=torch.float64)
    for j in range(length):
        prob *= reference_probs(target.logits(seqs[:, :j]), params).gather(1, seqs[:, j:j + 1]).squeeze(1)
    return prob


def complete(target: PrefixModel, params: SamplingParams, emitted: torch.Tensor, num_emitted: torch.Tensor,
             seed: int) -> torch.Tensor:
    """Fill the positions past num_emitted with plain float64 draws from the target's chain, so that
    a lossless step yields exactly the target's law of emitted.shape[1] tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = emitted.cpu().clone()
    num_emitted = num_emitted.cpu()
    for j in range(tokens.shape[1]):
        fresh = torch.multinomial(reference_probs(target.logits(tokens[:, :j].clamp_min(0)), params), 1,
                                  generator=g).squeeze(1)
        tokens[:, j] = torch.where(j < num_emitted, tokens[:, j], fresh)
    return tokens


def chi_square_pvalue(tokens: torch.Tensor, expected: torch.Tensor, vocab: int) -> float:
    """Chi-square test of sequences (int64 [N, L]) against their law (float64 [V ** L]); cells
    expecting fewer than 5 draws are pooled. Draws in a zero-probability cell fail outright."""
    cells = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for j in range(tokens.shape[1]):
        cells = cells * vocab + tokens[:, j]
    observed = torch.bincount(cells, minlength=len(expected)).double()
    impossible = observed[expected == 0].sum().item()
    assert impossible == 0, f"{impossible} draws outside the target's support"
    exp = expected * tokens.shape[0]
    small = exp < 5
    obs_cells = torch.cat([observed[~small], observed[small].sum()[None]])
    exp_cells = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp_cells > 0
    stat = ((obs_cells[keep] - exp_cells[keep]) ** 2 / exp_cells[keep]).sum().item()
    return float(chi2.sf(stat, int(keep.sum()) - 1))


# ---------------------------------------------------------------- one speculative step, as the worker runs it

def one_hot_step(h: Harness, slots: torch.Tensor, target: PrefixModel, drafts: torch.Tensor,
                 num_drafts: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat target logits (k_r + 1 rows per request), `sample` at offsets, padded, verified."""
    max_drafts = drafts.shape[1]
    num_tokens = int((num_drafts + 1).sum())
    request, offset = flat_rows(num_drafts.to(h.device), num_tokens)
    along = target.logits_along(drafts.clamp_min(0).cpu())  # [R, K + 1, V]
    logits = along[request.cpu(), offset.cpu()].to(h.device, dtype)
    sampled = h.sampler.sample(logits, slots[request], offsets=offset, record=False).sampled
    padded = flat_to_padded(sampled, num_drafts.to(h.device), max_drafts, -1)
    return verify_drafts(padded, drafts.to(h.device), num_drafts.to(h.device))


def propose(h: Harness, slots: torch.Tensor, draft: PrefixModel, max_drafts: int, stream: int,
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft model's proposals: (drafts int64 [R, K], q float32 [R, K, V]), one position at a time."""
    rows = len(slots)
    drafts = torch.zeros(rows, max_drafts, dtype=torch.int64, device=h.device)
    q = torch.empty(rows, max_drafts, h.vocab_size, device=h.device)
    for j in range(max_drafts):
        offsets = torch.full((rows,), j, dtype=torch.int64, device=h.device)
        q[:, j] = h.sampler.probs(draft.logits(drafts[:, :j]).to(h.device, dtype), slots, offsets)
        drafts[:, j] = h.sampler.draw(q[:, j], slots, offsets, stream)
    return drafts, q


def draft_model_step(h: Harness, slots: torch.Tensor, target: PrefixModel, draft: PrefixModel,
                     num_drafts: torch.Tensor, max_drafts: int, stream: int = NoiseStream.DRAFT,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Propose, score every position with the target (padded; NaN past each k_r, which must never
    be read), rejection-sample."""
    num_drafts = num_drafts.to(h.device)
    drafts, q = propose(h, slots, draft, max_drafts, stream, dtype)
    pad = torch.arange(max_drafts, device=h.device)[None, :] >= num_drafts[:, None]
    drafts = drafts.masked_fill(pad, -1)
    q.masked_fill_(pad[:, :, None], torch.nan)
    p = torch.full((len(slots), max_drafts + 1, h.vocab_size), torch.nan, device=h.device)
    along = target.logits_along(drafts.clamp_min(0).cpu())
    for j in range(max_drafts + 1):
        offsets = torch.full((len(slots),), j, dtype=torch.int64, device=h.device)
        p[:, j] = h.sampler.probs(along[:, j].to(h.device, dtype), slots, offsets)
    p.masked_fill_((torch.arange(max_drafts + 1, device=h.device)[None, :] > num_drafts[:, None])[:, :, None],
                   torch.nan)
    return rejection_sample(h.sampler, slots, p, q, drafts, num_drafts)


class ChainModel:
    """Logits (float64 [V]) as a fixed function of (output position, previous token): long
    generations whose speculative and plain runs are compared token for token. Token `eos` gets a
    boost, so that min_tokens has something to ban."""

    def __init__(self, vocab: int, length: int, seed: int, eos: int | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.table = torch.randn(length, vocab + 1, vocab, generator=g, dtype=torch.float64) * 2.0
        if eos is not None:
            self.table[..., eos] += 3.0

    def logits(self, positions: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """positions, previous: int64 [N] (previous -1: none yet) -> float64 [N, V]."""
        return self.table[positions.cpu(), previous.cpu() % (self.vocab + 1)]

    def along(self, start: torch.Tensor, last: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """float64 [R, K + 1, V]: the logits at positions start + j after last, d_0, .., d_{j-1}."""
        rows, max_drafts = drafts.shape
        previous = torch.cat([last[:, None], drafts.clamp_min(0)], dim=1)
        positions = start[:, None] + torch.arange(max_drafts + 1)
        return self.logits(positions.reshape(-1), previous.reshape(-1)).view(rows, max_drafts + 1, self.vocab)
