"""The decode probe's verdict (benchmarks/decode_consistency.judge), on the counts the two-H100 check
reported (session of 2026-11-26, fourth): the one-GPU reference parted on 3 of 48 sequences (2 not at
a near tie), so a layout parting on 8 passes; a shard offset bug parts on nearly all and fails."""

from tokenmill.benchmarks.decode_consistency import judge


def _result(near_ties: int, parted: int, mean: float = 2.4e-2, sequences: int = 48) -> dict:
    return {"sequences": sequences, "tail_near_ties": near_ties, "tail_parted": parted, "mean": mean}


REFERENCE = _result(1, 2, mean=2.34e-2)


def test_partings_within_the_reference_spread_pass():
    assert judge(_result(6, 2), REFERENCE)
    assert judge(_result(0, 0), REFERENCE)


def test_a_layout_whose_greedy_tail_parts_everywhere_fails():
    assert not judge(_result(3, 40), REFERENCE)
    assert not judge(_result(0, 13), REFERENCE)


def test_the_decode_path_mean_still_counts():
    assert not judge(_result(0, 0, mean=0.2), REFERENCE)
