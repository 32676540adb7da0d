"""The two layouts of a speculative step's rows, and the index tensors between them.

Request r of a step has k_r = num_drafts[r] drafts, so the model scores k_r + 1 positions for it
(output offsets 0..k_r: the token after its last known one, then after each draft).
  flat:   what the model's logits look like: the requests' positions concatenated, T = sum(k_r + 1)
          rows (a group of rows per request, in request order);
  padded: [R, K + 1], position j of request r at [r, j]; entries past k_r are padding.
Everything is made on the device from num_drafts: no host sync (T, known to the host that built the
step's inputs, is passed in where a shape depends on it).
"""

from __future__ import annotations

import torch


def flat_rows(num_drafts: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request int64 [T], offset int64 [T]) of each flat row: which request it belongs to and its
    output offset in that request (0..k_r). num_tokens: T = sum(num_drafts + 1)."""
    lengths = num_drafts + 1
    request = torch.repeat_interleave(torch.arange(len(num_drafts), device=num_drafts.device), lengths,
                                      output_size=num_tokens)
    starts = lengths.cumsum(0).sub_(lengths)
    offset = torch.arange(num_tokens, device=num_drafts.device).sub_(starts[request])
    return request, offset


def padded_index(lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For groups of lengths[r] consecutive flat rows: (index int64 [R, width], valid bool [R, width]).
    index[r, j] is the flat row of group r's j-th member; past the group's end it repeats the group's
    last row (its first when the group is empty), always inside [0, sum(lengths)) unless that is 0."""
    starts = lengths.cumsum(0).sub_(lengths)
    j = torch.arange(width, device=lengths.device)
    last = (lengths - 1).clamp_(min=0)
    index = starts[:, None] + torch.minimum(j[None, :], last[:, None])
    index = index.clamp_(max=(lengths.sum() - 1).clamp_(min=0))  # an empty last group points inside
    return index, j[None, :] < lengths[:, None]


def flat_to_padded(flat: torch.Tensor, num_drafts: torch.Tensor, max_drafts: int,
                   fill: float | int) -> torch.Tensor:
    """flat [T, ...] (one row per position, T = sum(num_drafts + 1)) to padded [R, K + 1, ...]
    (K = max_drafts >= every k_r), with `fill` past each request's k_r + 1 positions."""
    index, valid = padded_index(num_drafts + 1, max_drafts + 1)
    padded = flat.index_select(0, index.reshape(-1)).view(*index.shape, *flat.shape[1:])
    mask = valid.view(*valid.shape, *([1] * (flat.dim() - 1)))
    return padded.masked_fill_(~mask, fill)
