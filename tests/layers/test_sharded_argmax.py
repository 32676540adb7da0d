"""The greedy argmax over TP vocab shards without gathering the logits (`ParallelLMHead.argmax`'s
arithmetic): each shard's packed maximum, id and finiteness, then the pick across ranks, equal
to argmax and the finiteness screen over the whole rows, ties and a padded last shard included."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.parallel_linear import pack_shard_argmax, pick_sharded_argmax


@pytest.mark.parametrize("tp,vocab", [(2, 11), (2, 64), (3, 10), (4, 13)])
def test_sharded_argmax_equals_whole_row_argmax(tp: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(tp * 100 + vocab)
    rows = 64
    logits = torch.randint(-3, 4, (rows, vocab), generator=g).float()  # small integers: many ties
    logits[5, 2] = float("nan")
    logits[6, vocab - 1] = float("inf")
    logits[7] = -5.0  # all below the padding columns' zeros
    per_rank = -(-vocab // tp)
    padded = torch.cat([logits, torch.zeros(rows, per_rank * tp - vocab)], dim=1)  # the last shard's padding
    packs = []
    for r in range(tp):
        start = r * per_rank
        count = max(0, min(per_rank, vocab - start))
        packs.append(pack_shard_argmax(padded[:, start:start + per_rank], start, count))
    ids, bad = pick_sharded_argmax(torch.stack(packs))
    want_bad = ~torch.isfinite(logits.sum(dim=-1))
    assert bad.tolist() == want_bad.tolist()
    assert ids[~want_bad].tolist() == logits.argmax(dim=-1)[~want_bad].tolist()
    assert ids[7].item() == 0  # the first of an all-equal row
