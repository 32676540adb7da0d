"""Verification of a speculative step: which drafts a request keeps, and the token it emits after them.

Request r proposed k_r = num_drafts[r] <= K drafts d_0..d_{k_r-1}; the target scored its k_r + 1
positions. Both rules return `emitted` int64 [R, K + 1] (a drafts kept, then one more token; -1
after) and `num_emitted` = a + 1 in 1..k_r + 1. Pure torch over the batch: no host sync, no Python
per row. They need only the target's per-row sampling state (the Sampler); the rows are the padded
layout of spec_layout.py.

**One-hot drafts** (`verify_drafts`: the n-gram proposer, and greedy rows of any proposer). The
target samples its own token x_j at each position j (`Sampler.sample(..., offsets=j)`, the same draw
it makes without speculation); a = the number of leading j < k_r with x_j == d_j; emit x_0..x_a.
This is the lossless rule for q = onehot(d) exactly, not an approximation of it:
  - accept d_j with probability min(1, p(d_j) / q(d_j)) = min(1, p(d_j) / 1) = p(d_j), and
    P(x_j == d_j) = p(d_j);
  - on rejection the rule emits a token from normalized max(p - onehot(d_j), 0), which is p(t) /
    (1 - p(d_j)) for t != d_j and 0 for d_j; here the emitted token is x_j given x_j != d_j, whose
    law is p(t) / (1 - p(d_j)) for t != d_j: the same;
  - when all k_r drafts are accepted, x_{k_r} is a sample of p at the next position: the bonus token.
x_j draws fresh noise for position j (seeded rows: a hash of (seed, position), independent across
positions; others: torch's generator), and whether position j is reached depends only on x_0..x_{j-1},
so each emitted token has the target's law given the tokens before it. Seeded and greedy requests
emit exactly the tokens they emit without speculation: x_j is the very sample the plain path draws
at that position given the same tokens before it (tests/layers/test_spec_verify.py checks both).

**Draft distributions** (`rejection_sample`: the draft-model proposer, d_j ~ q_j). Position j < k_r
accepts while u_j * q_j(d_j) < p_j(d_j) (u_j < p/q without dividing; u_j ~ U(0, 1) from the ACCEPT
stream at that output position); at the first rejection j = a it emits a draw from max(p_a - q_a, 0)
(RESIDUAL stream; from p_a should that be all zero, which needs p_a <= q_a everywhere, i.e. a
rejection of probability 0 up to rounding); after k_r acceptances the bonus token is drawn from
p_{k_r} (MAIN stream, the stream plain sampling uses). Greedy rows fall out of the same rule, since
Sampler.probs gives them one-hot p and q: accept iff d_j is the target's argmax, else emit it.
Draws stay independent: every quantity that decides the emitted tokens comes from a distinct
(position, stream) pair or a fresh generator draw. The proposer may draw d_j from MAIN or DRAFT:
MAIN makes a target-as-draft run (q == p) emit the plain path's tokens for seeded requests.

Memory: beyond p(d) and q(d) ([R, K] gathers) only the final position's two rows are read in full
([R, V] each): no [R, K, V] temporary. Both probability inputs may be padded ([R, K + 1, V] and
[R, K, V]) or flat ([sum(k_r + 1), V] and [sum(k_r), V]), so the worker need not copy them.
"""

from __future__ import annotations

import torch

from tokenmill.layers.sampling.sampler import Sampler
from tokenmill.layers.sampling.seeded_noise import NoiseStream
from tokenmill.layers.sampling.spec_layout import padded_index


@torch.inference_mode()
def verify_drafts(sampled: torch.Tensor, drafts: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One-hot drafts. sampled int64 [R, K + 1] (the target's own sample at each position),
    drafts int64 [R, K], num_drafts int64 [R] -> (emitted int64 [R, K + 1], num_emitted int64 [R])."""
    max_drafts = drafts.shape[1]
    matched = (sampled[:, :max_drafts] == drafts) & _valid(num_drafts, max_drafts)
    num_emitted = _leading(matched) + 1
    return _keep(sampled, num_emitted), num_emitted


@torch.inference_mode()
def rejection_sample(sampler: Sampler, slots: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor, drafts: torch.Tensor,
                     num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft distributions. slots int64 [R] (each request's sampling slot); target_probs float32
    [R, K + 1, V] or flat [sum(k_r + 1), V] (Sampler.probs at offsets 0..k_r); draft_probs float32
    [R, K, V] or flat [sum(k_r), V] (the proposer's q, whose draws are `drafts` int64 [R, K]);
    num_drafts int64 [R] -> (emitted int64 [R, K + 1], num_emitted int64 [R]). Inputs untouched."""
    num_rows, max_drafts = drafts.shape
    valid = _valid(num_drafts, max_drafts)
    d = drafts.masked_fill(~valid, 0)  # padding may hold anything; gather at a real id
    p, p_index = _rows(target_probs, num_drafts + 1, max_drafts + 1)
    q, q_index = _rows(draft_probs, num_drafts, max_drafts)
    vocab = p.shape[1]
    p_d = torch.take(p, p_index[:, :max_drafts] * vocab + d)
    q_d = torch.take(q, q_index * vocab + d) if q.numel() else torch.zeros_like(p_d)
    offsets = torch.arange(max_drafts, device=d.device).expand(num_rows, -1)
    u = sampler.uniforms(slots, offsets, d, NoiseStream.ACCEPT)
    num_accepted = _leading(_accepts(u, p_d, q_d) & valid)
    rejected = num_accepted < num_drafts

    # The final position a: the first rejection (draw from the residual) or k_r (the bonus token).
    p_final = p.index_select(0, p_index.gather(1, num_accepted[:, None]).squeeze(1))
    if q.numel():
        at = num_accepted.clamp(max=max(max_drafts - 1, 0))
        q_final = q.index_select(0, q_index.gather(1, at[:, None]).squeeze(1))
        weights = _residual(p_final, q_final, rejected)
    else:
        weights = p_final
    stream = torch.where(rejected, NoiseStream.RESIDUAL, NoiseStream.MAIN)
    final = sampler.draw(weights, slots, num_accepted, stream)

    emitted = torch.cat([drafts, drafts.new_empty(num_rows, 1)], dim=1)
    emitted.scatter_(1, num_accepted[:, None], final[:, None])
    return _keep(emitted, num_accepted + 1), num_accepted + 1


def _accepts(u: torch.Tensor, p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """u < p(d) / q(d), as u * q(d) < p(d) (q(d) = 0: accept where p(d) > 0)."""
    return u * q_d < p_d


def _residual(p_final: torch.Tensor, q_final: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0) on rejected rows, p on the others (bonus rows), p where the residual is all
    zero. In place on q_final. Unnormalized: the exponential race needs only the proportions."""
    weights = q_final.masked_fill_(~rejected[:, None], 0.0).neg_().add_(p_final).clamp_min_(0.0)
    return torch.where(weights.sum(dim=-1, keepdim=True) > 0, weights, p_final, out=weights)


def _valid(num_drafts: torch.Tensor, max_drafts: int) -> torch.Tensor:
    return torch.arange(max_drafts, device=num_drafts.device)[None, :] < num_drafts[:, None]


def _leading(flags: torch.Tensor) -> torch.Tensor:
    """int64 [R]: the number of leading True entries of each row of flags bool [R, K]."""
    return flags.to(torch.int32).cumprod_(dim=1).sum(dim=1)


def _keep(tokens: torch.Tensor, num_emitted: torch.Tensor) -> torch.Tensor:
    """tokens [R, K + 1] with -1 from position num_emitted[r] on (a new tensor)."""
    past = torch.arange(tokens.shape[1], device=tokens.device)[None, :] >= num_emitted[:, None]
    return tokens.masked_fill(past, -1)


def _rows(probs: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D [rows, V] view of padded [R, width, V] or flat [sum(lengths), V] probabilities, and
    index int64 [R, width]: the row of each request's j-th position (clamped to its last one)."""
    if probs.dim() == 3:
        assert probs.shape[1] == width, (probs.shape, width)
        num_rows = probs.shape[0]
        j = torch.arange(width, device=probs.device)
        last = (lengths - 1).clamp_(min=0)
        index = torch.arange(num_rows, device=probs.device)[:, None] * width + torch.minimum(j[None, :], last[:, None])
        return probs.reshape(num_rows * width, probs.shape[2]), index
    assert probs.dim() == 2, probs.shape
    return probs, padded_index(lengths, width)[0]
