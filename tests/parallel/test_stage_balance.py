"""Pipeline partitions balanced by measured time (`distributed/stage_balance.py`) and the CPU probe
that measures (`worker/stage_probe.py`)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import ParallelConfig
from tokenmill.distributed.layout import parse_partition
from tokenmill.distributed.stage_balance import StageCosts, balanced_partition, explain


def costs(layers: int, layer: float = 1.0, embedding: float = 0.0, head: float = 0.0) -> StageCosts:
    return StageCosts(layers=(layer,) * layers, embedding=embedding, head=head)


def test_a_light_head_keeps_the_even_split():
    # The 8B case on two H100s: a layer ~0.65 ms of a micro-batch step, the head ~0.3: 17/15 would
    # make stage 0 slower than 16/16's last stage.
    assert balanced_partition(costs(32, 0.65, 0.01, 0.3), 2) == (16, 16)
    assert balanced_partition(costs(32), 2) == (16, 16)


def test_a_heavy_head_moves_layers_to_the_first_stage():
    # Batch 1: the LM head reads as many bytes as ~5 layers.
    assert balanced_partition(costs(32, 1.0, 0.01, 4.8), 2) == (18, 14)
    assert balanced_partition(costs(32, 1.0, 0.01, 1.5), 2) == (17, 15)
    # A heavy embedding the other way (never in practice, but the arithmetic is symmetric).
    assert balanced_partition(costs(32, 1.0, 4.0, 0.0), 2) == (14, 18)


def test_the_slowest_stage_is_minimal_over_every_split():
    c = StageCosts(layers=(1.0, 2.0, 0.5, 3.0, 1.0, 1.5, 2.5), embedding=0.7, head=2.2)
    for stages in (2, 3, 4):
        best = min(max(c.stage_times(p)) for p in _compositions(7, stages))
        got = balanced_partition(c, stages)
        assert sum(got) == 7 and min(got) >= 1
        assert max(c.stage_times(got)) == pytest.approx(best)


def _compositions(n: int, k: int):
    if k == 1:
        yield (n,)
        return
    for first in range(1, n - k + 2):
        for rest in _compositions(n - first, k - 1):
            yield (first, *rest)


def test_uneven_layer_counts_go_first_when_costs_tie():
    assert balanced_partition(costs(3), 2) == (2, 1)
    assert balanced_partition(costs(10), 4) in ((3, 3, 2, 2), (3, 2, 3, 2), (2, 3, 3, 2), (3, 2, 2, 3),
                                                 (2, 3, 2, 3), (2, 2, 3, 3))


def test_bad_stage_counts_name_the_field():
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        balanced_partition(costs(3), 4)


def test_the_log_line_says_why():
    line = explain(costs(32, 1.0, 0.01, 1.5), (17, 15))
    assert line.startswith("17,15 (stage times 17.010 / 16.500 ms")
    assert "the even split 16,16 would give 16.010 / 17.500" in line


def test_even_and_measured_are_words_of_the_flag():
    assert parse_partition("even", 5, 2) == (3, 2)
    assert not ParallelConfig().balance_stages


def test_the_probe_times_a_layer_the_embedding_and_the_head_on_cpu():
    from tokenmill.config import ModelArch
    from tokenmill.worker.stage_probe import measure

    arch = ModelArch(architecture="LlamaForCausalLM", model_type="llama", vocab_size=4096, hidden_size=64,
                     intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                     rms_norm_eps=1e-5, max_position=128)
    c = measure(arch, torch.float32, torch.device("cpu"), rows=4, context=32, tp=2)
    assert len(c.layers) == 3 and all(t > 0 for t in (*c.layers, c.embedding, c.head))
    assert len(c.attention) == 3 and all(0 < a < whole for a, whole in zip(c.attention, c.layers))


# ---------------------------------------------------------------- half layers


def test_half_layers_even_out_a_head_whole_layers_cannot():
    from tokenmill.distributed.layout import split_from_halves
    from tokenmill.distributed.stage_balance import balanced_halves, explain_halves
    # Last session's 330-row decode step on two H100s: a layer 0.6 ms, the head 0.73 beyond the
    # embedding. Whole layers: 16/16 idles stage 0 0.73 a step, 17/15 stage 1 0.47 (10.2 ms the
    # step); with the attention half at 0.33, 16.5/15.5 leaves 0.07 (10.0 ms).
    c = StageCosts(layers=(0.6,) * 32, embedding=0.0, head=0.73, attention=(0.33,) * 32)
    assert balanced_partition(c, 2) == (17, 15)
    halves = balanced_halves(c, 2)
    assert halves == (33, 31)
    assert split_from_halves(halves) == ((16, 16), (True,))
    times = c.halves().stage_times(halves)
    assert times == pytest.approx([16 * 0.6 + 0.33, 15 * 0.6 + 0.27 + 0.73])
    assert explain_halves(c, halves).startswith("16.5,15.5 (stage times 9.930 / 10.000 ms")
    # A heavier head: a whole layer more, and half of the next.
    c = StageCosts(layers=(0.6,) * 32, embedding=0.0, head=1.6, attention=(0.3,) * 32)
    assert balanced_halves(c, 2) == (35, 29)
    # Every stage keeps at least one layer's worth (an attention and its KV cache).
    c = StageCosts(layers=(1.0,) * 3, embedding=0.0, head=100.0, attention=(0.5,) * 3)
    assert balanced_halves(c, 2) == (4, 2)
    with pytest.raises(ValueError):
        StageCosts(layers=(1.0,) * 3, embedding=0.0, head=0.0).halves()


# ---------------------------------------------------------------- a mix of step kinds


def test_a_mix_weighs_each_kind_at_its_own_slowest_stage():
    from tokenmill.distributed.stage_balance import balanced_for_mix
    decode = costs(32, 0.6, 0.0, 0.9)  # the head ~1.5 layers on every row: 17/15 alone
    prompt = costs(32, 2.6, 0.0, 0.05)  # the head on a chunk's last tokens only: 16/16 alone
    assert balanced_for_mix([(1.0, decode)], 2) == (17, 15)
    assert balanced_for_mix([(1.0, prompt)], 2) == (16, 16)
    # Weights are step counts: 95 decode steps to 5 prompt chunks, 17/15 (95 * 10.2 + 5 * 44.2 =
    # 1190 against 95 * 10.5 + 5 * 41.65 = 1205.75); 70 to 30, 16/16 (1984.5 against 2040).
    assert balanced_for_mix([(95, decode), (5, prompt)], 2) == (17, 15)
    assert balanced_for_mix([(70, decode), (30, prompt)], 2) == (16, 16)
    # Against every split: the weighted sum of slowest stages is minimal.
    c1 = StageCosts(layers=(1.0, 2.0, 0.5, 3.0, 1.0, 1.5, 2.5), embedding=0.7, head=2.2)
    c2 = StageCosts(layers=(2.0, 1.0, 1.0, 1.0, 3.0, 0.5, 0.5), embedding=0.1, head=0.1)
    for stages in (2, 3):
        got = balanced_for_mix([(0.5, c1), (0.5, c2)], stages)
        best = min(0.5 * max(c1.stage_times(p)) + 0.5 * max(c2.stage_times(p)) for p in _compositions(7, stages))
        assert 0.5 * max(c1.stage_times(got)) + 0.5 * max(c2.stage_times(got)) == pytest.approx(best)


def test_a_run_measures_the_layer_and_the_head():
    from tokenmill.distributed.stage_balance import costs_from_stage_times
    c = costs_from_stage_times([9.6, 10.5], (16, 16))
    assert c.layers == (0.6,) * 32 and c.head == pytest.approx(0.9) and c.embedding == 0.0
    assert balanced_partition(c, 2) == (17, 15)
    c = costs_from_stage_times([10.2, 9.9], (17, 15))  # the same model, measured under 17/15
    assert c.layers[0] == pytest.approx(0.6) and c.head == pytest.approx(0.9)
    # Three stages, an embedding taken off the first; a head faster than nothing is no head.
    c = costs_from_stage_times([5.1, 5.0, 4.0], (5, 5, 5), embedding=0.1)
    assert c.layers[0] == pytest.approx(1.0) and c.head == 0.0
    with pytest.raises(ValueError):
        costs_from_stage_times([1.0], (4,))


def test_the_measured_partition_takes_half_layers_where_the_probe_timed_them(tmp_path):
    """Rank 0's choice as every rank receives it (a world of one, gloo): half layers where the
    costs have attention halves (the Llama layer), whole layers where they do not."""
    import torch.distributed as dist

    from tokenmill.distributed.parallel_state import _measured_partition

    halves = StageCosts(layers=(0.6,) * 32, embedding=0.0, head=0.73, attention=(0.33,) * 32)
    whole = StageCosts(layers=(0.6,) * 32, embedding=0.0, head=0.73)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        cpu = torch.device("cpu")
        assert _measured_partition(lambda: halves, 2, 32, cpu) == ((16, 16), (True,))
        assert _measured_partition(lambda: whole, 2, 32, cpu) == ((17, 15), ())
    finally:
        dist.destroy_process_group()
