"""The teacher-forced layout check (tokenmill/benchmarks/layout_check.py) on CPU with gloo: TP=2 in
float32, TP=2 sync and PP=2 in bfloat16 land within the spread of two valid one-process
reductions; a TP=2 engine with one rank's rows of a weight swapped (the worker's test-only
`wrong_shard` fault) fails it. Plus the comparison's arithmetic on crafted logprobs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.parallel.conftest import FAMILIES
from tokenmill.benchmarks import layout_check as lc
from tokenmill.worker.fault_injection import ENV_VAR

COMMON = dict(kv_cache_memory_gb=0.01)
# Rank 1's first 16 gate rows of layer 1 traded with its next 16: a TP shard loaded in the wrong order.
WRONG_SHARD = {ENV_VAR: json.dumps({"wrong_shard": {"rank": 1, "parameter": "layers.1.mlp.gate_up_proj.weight",
                                                    "rows": [0, 16], "count": 16}})}


@pytest.fixture(scope="module")
def sequences(tiny_model) -> list[list[int]]:
    """Three random prompts, each with the one-process greedy continuation (float32)."""
    assert FAMILIES["llama"]["num_hidden_layers"] == 3  # the fault's layer 1 exists on every layout
    prompts = lc.random_prompts(lc.vocab_size(tiny_model), [5, 17, 40])
    return lc.greedy_continuations(tiny_model, lc.base_layout(single_process=True), prompts, 12,
                                   dict(dtype="float32", **COMMON))


@pytest.mark.parametrize("dtype,layouts,wrong", [
    ("float32", ("tp2",), False),  # PP=2 in float32: greedy-equal in test_split_equals_one_process.py
    ("bfloat16", ("tp2-sync", "pp2"), True),
])
def test_layouts_within_reference_spread(tiny_model, sequences, dtype, layouts, wrong) -> None:
    wrong_layout = lc.Layout("tp2-wrong-shard", lc.PRESETS["tp2"])
    report = lc.check_layouts(tiny_model, [*(lc.Layout.parse(n) for n in layouts), *([wrong_layout] * wrong)],
                              sequences, dict(dtype=dtype, **COMMON), envs={wrong_layout.name: WRONG_SHARD},
                              one_process=dict(single_process=True))
    print("\n" + lc.format_report(report))
    ref = report.reference
    assert ref.positions == sum(len(s) - 1 for s in sequences)
    if dtype == "bfloat16":  # the reference is a real spread, not the floor
        assert ref.mean > lc.rounding_floor(dtype)
    verdicts = {v.spread.label: v for v in report.verdicts}
    for name in layouts:
        assert verdicts[name].passed, lc.format_report(report)
        assert verdicts[name].spread.top1 >= 0.95
    if wrong:
        bad = verdicts[wrong_layout.name]
        assert not bad.passed and min(bad.ratios.values()) > 2 * bad.factor, lc.format_report(report)


def test_compare_on_crafted_logprobs() -> None:
    rng = np.random.default_rng(0)
    a = [rng.normal(0, 2.0, (6, 10)).astype(np.float32)]
    same = lc.compare("same", a, a)
    assert same.mean == same.max == 0 and same.top1 == same.topk == 1
    shifted = [a[0] + np.float32(0.02) * np.eye(6, 10, dtype=np.float32)]  # one entry per row moves
    s = lc.compare("shifted", shifted, a)
    assert s.max == pytest.approx(float((0.02 / a[0].std(axis=1)).max()), rel=1e-4)
    assert s.mean == pytest.approx(float((0.02 / a[0].std(axis=1)).sum() / 60), rel=1e-4)
    swapped = [a[0][:, ::-1].copy()]  # the ranking reversed
    assert lc.compare("swapped", swapped, a).top1 < 1
    reference = lc.Spread("ref", 6, 1e-3, 2e-3, 4e-3, 1.0, 1.0)
    assert lc.judge(lc.Spread("x", 6, 3e-3, 6e-3, 1.2e-2, 1, 1), reference, "float32").passed
    assert not lc.judge(lc.Spread("x", 6, 3e-3, 6e-3, 1.7e-2, 1, 1), reference, "float32").passed
    exact = lc.Spread("exact", 6, 0.0, 0.0, 0.0, 1.0, 1.0)  # a reference with no rounding: the floor
    assert lc.judge(lc.Spread("x", 6, 1e-8, 1e-8, 1e-8, 1, 1), exact, "float32").passed


def test_layout_parsing() -> None:
    assert lc.Layout.parse("tp2-sync").engine == dict(tensor_parallel_size=2, async_scheduling=False)
    assert lc.Layout.parse("tp=2,pp=2,async=0").engine == dict(
        tensor_parallel_size=2, pipeline_parallel_size=2, async_scheduling=False)
    assert [x.name for x in lc.parse_layouts("tp2,pp2")] == ["tp2", "pp2"]
    assert [x.name for x in lc.parse_layouts("tp=2,async=0;pp2")] == ["tp=2,async=0", "pp2"]
    with pytest.raises(ValueError, match="tq=2"):
        lc.Layout.parse("tq=2")
