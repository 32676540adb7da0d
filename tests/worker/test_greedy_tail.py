"""The greedy step-end graph's body (`GreedyTail.body`) without a model: from a forward graph's
logits and rows to the packed result and the device state it writes. Verification keeps the
matching drafts plus one token, takes rejected drafts off the computed counts, records the
emitted tokens in the speculator's history, flags rows with non-finite logits (but not for
padding positions past a row's drafts), and leaves the scratch slot's state alone."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tokenmill.config import SpeculativeConfig
from tokenmill.protocol import RowFailure
from tokenmill.worker.greedy_tail import GreedyTail
from tokenmill.worker.speculator import Speculator

VOCAB, K, SCRATCH = 11, 2, 5
BAD = -int(RowFailure.NON_FINITE_LOGITS)


def logits_choosing(tokens: list[int]) -> torch.Tensor:
    """[len(tokens), VOCAB] whose argmax is each token."""
    x = torch.zeros(len(tokens), VOCAB)
    x[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return x


def make(query_len: int, slots: list[int], logits: torch.Tensor, num_drafts: list[int], drafts: dict[int, list[int]]):
    batch = SimpleNamespace(scratch=SCRATCH, next_token_dev=torch.zeros(SCRATCH + 1, dtype=torch.int64),
                            num_computed_dev=torch.full((SCRATCH + 1,), 10, dtype=torch.int64))
    batch.num_computed_dev[SCRATCH] = 0
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=K), SCRATCH + 1, 64, batch.next_token_dev)
    spec.resume([(slot, [1, 2, 3], False) for slot in range(SCRATCH)])
    spec.flush()
    for slot, tokens in drafts.items():
        spec.drafts[slot] = torch.tensor(tokens)
    size = len(slots)
    graphs = SimpleNamespace(query_len=query_len, slots=torch.tensor(slots), logits={size: logits},
                             num_drafts=torch.tensor(num_drafts), drafts=spec.drafts, last_stage=True,
                             sizes=[size], padded_size=lambda n: size, local_logits=False,
                             whole_logits=lambda x: x)
    # The forward graph advanced each real row by 1 + its drafts before the tail runs.
    for slot, n in zip(slots, num_drafts):
        if slot != SCRATCH:
            batch.num_computed_dev[slot] += n + 1
    return GreedyTail(graphs, batch, spec), batch, spec


def test_verification_rows_bonus_rejection_failure_padding_and_scratch() -> None:
    rows = [  # (slot, drafts, num_drafts, target argmax at the 3 positions, a NaN position or None)
        (0, [4, 6], 2, [4, 6, 9], None),  # both accepted: 4 6 and the bonus 9
        (1, [4, 6], 2, [4, 7, 9], None),  # the second rejected: 4 7
        (2, [8, 8], 1, [3, 8, 8], 0),  # NaN at a verified position: the row fails
        (3, [8, 8], 0, [5, 2, 2], 2),  # NaN at a padding position (past its 0 drafts): fine
        (SCRATCH, [0, 0], 0, [1, 1, 1], None),  # a padded row
    ]
    logits = logits_choosing([t for row in rows for t in row[3]])
    for i, row in enumerate(rows):
        if row[4] is not None:
            logits[3 * i + row[4], 2] = float("nan")
    tail, batch, spec = make(3, [r[0] for r in rows], logits, [r[2] for r in rows],
                             {r[0]: r[1] for r in rows if r[0] != SCRATCH})
    packed = tail.run(len(rows))
    assert packed[:4].tolist() == [[4, 6, 9, 3], [4, 7, -1, 2], [0, -1, -1, BAD], [5, -1, -1, 1]]
    assert batch.next_token_dev[:4].tolist() == [9, 7, 0, 5]
    assert batch.num_computed_dev.tolist() == [13, 12, 11, 11, 10, 0]  # 10 + emitted; scratch untouched
    assert spec.history_len.tolist() == [6, 5, 4, 4, 3, 0]
    assert spec.history[0, :6].tolist() == [1, 2, 3, 4, 6, 9] and spec.history[1, :5].tolist() == [1, 2, 3, 4, 7]


def test_plain_decode_rows() -> None:
    logits = logits_choosing([3, 7, 2])
    logits[1, 0] = float("inf")
    tail, batch, spec = make(1, [2, 0, SCRATCH], logits, [0, 0, 0], {})
    assert tail.run(3).tolist() == [3, BAD, 2]
    assert batch.next_token_dev[[2, 0]].tolist() == [3, 0]  # a failed row still gets a valid input
    assert spec.history_len.tolist() == [4, 3, 4, 3, 3, 0] and spec.history[2, 3] == 3


def test_plain_decode_rows_from_vocab_shards() -> None:
    """TP (`DecodeGraphs.local_logits`): the forward graph left rank 0's vocab columns; the tail takes
    the argmax across ranks (`ParallelLMHead.argmax`, here over rank 1's columns held aside) and
    gets the same tokens and failures as from the whole rows."""
    from tokenmill.layers.parallel_linear import pack_shard_argmax, pick_sharded_argmax
    logits = logits_choosing([3, 7, 2, 9, 8])
    logits[1, 0] = float("inf")  # rank 0's part of row 1 not finite
    logits[3, 9] = logits[3, 4] = 1.0  # a tie across the ranks: the lower id wins
    per_rank = 6  # 11 = 6 + 5: rank 1's shard has one padding column (never chosen)
    other = torch.cat([logits[:, per_rank:], torch.full((5, 1), 5.0)], dim=1)
    head = SimpleNamespace(argmax=lambda local: pick_sharded_argmax(torch.stack(
        [pack_shard_argmax(local, 0, per_rank), pack_shard_argmax(other, per_rank, VOCAB - per_rank)])))

    def no_gather(_):
        raise AssertionError("a plain greedy tail must not gather the logits")

    tail, batch, spec = make(1, [2, 0, 1, 3, SCRATCH], logits[:, :per_rank].clone(), [0] * 5, {})
    tail.graphs.local_logits, tail.graphs.model = True, SimpleNamespace(logits_head=head)
    tail.graphs.whole_logits = no_gather
    assert tail.run(5).tolist() == [3, BAD, 2, 4, 8]
    assert batch.next_token_dev[[2, 0, 1, 3]].tolist() == [3, 0, 2, 4]
