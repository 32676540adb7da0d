"""Speculation counters in `LLM.telemetry()` (the window since the last reset) and in
`tokenmill bench throughput`'s printout and JSON record."""

from __future__ import annotations

import json

from tests.engine.conftest import tiny_llm
from tests.engine.test_speculative import GREEDY, NGRAM, repetitive_prompts
from tokenmill.cli import main as cli_main
from tokenmill.metrics.spec_decode import from_scheduler_stats, since, spec_figures


def test_telemetry_reports_speculation_since_its_reset(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir, speculative_config=NGRAM)
    llm.generate(repetitive_prompts(4), GREEDY, use_tqdm=False)
    first = llm.telemetry().speculation
    assert first == from_scheduler_stats(llm.scheduler_stats())  # no reset yet: since the start
    assert first.num_accepted_tokens > 0 and len(first.accepted_per_position) == NGRAM["num_speculative_tokens"]

    llm.reset_telemetry()
    empty = llm.telemetry().speculation
    assert (empty.num_drafts, empty.num_draft_tokens, empty.num_accepted_tokens) == (0, 0, 0)
    assert empty.accepted_per_position == [0] * NGRAM["num_speculative_tokens"]

    llm.generate(repetitive_prompts(4, seed=9), GREEDY, use_tqdm=False)
    window = llm.telemetry().speculation
    assert window == since(first, from_scheduler_stats(llm.scheduler_stats()))
    assert 0 < window.num_accepted_tokens <= window.num_draft_tokens
    assert sum(window.accepted_per_position) == window.num_accepted_tokens
    figures = spec_figures(window)
    assert figures["mean_acceptance_length"] == 1 + window.num_accepted_tokens / window.num_drafts
    assert figures["acceptance_rate"] == window.num_accepted_tokens / window.num_draft_tokens
    llm.shutdown()


def test_no_speculation_in_telemetry_without_it(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    llm.generate(repetitive_prompts(1), GREEDY, use_tqdm=False)
    assert llm.telemetry().speculation is None
    llm.shutdown()


def test_bench_throughput_prints_and_records_speculation(tiny_model_dir, tmp_path, capsys):
    """Multi-process (the default): the counters cross from the core to the front-end."""
    record_path = tmp_path / "record.json"
    code = cli_main(["--log-level", "WARNING", "bench", "throughput", "--model", tiny_model_dir,
                     "--dataset", "text", "--num-prompts", "4", "--input-len", "24", "--output-len", "24",
                     "--ignore-eos", "--dtype", "float32", "--kv-cache-memory-gb", "0.01",
                     "--speculative-config", json.dumps(NGRAM), "--output-json", str(record_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "== speculative decoding ==" in out and "mean acceptance length" in out
    record = json.loads(record_path.read_text())
    spec = record["tokenmill"]["speculative_decoding"]
    assert spec["num_drafts"] > 0 and 0 < spec["accepted_tokens"] <= spec["draft_tokens"], spec
    assert sum(spec["accepted_per_position"]) == spec["accepted_tokens"]
    # No more than the timed pass alone can draft (each verified step emits a token, so at most
    # output_len steps of k drafts per request): the warm-up pass ran before the reset.
    assert spec["draft_tokens"] <= 4 * 24 * NGRAM["num_speculative_tokens"]
    assert "speculative_decoding" not in record["tokenmill_warmup_passes"][0]


def test_bench_spec_interleaves_rounds_and_pools_them(tiny_model_dir, tmp_path, capsys):
    """`bench spec --rounds 2 --dataset random --repeat-prompts`: both engines alive, two timed
    passes each on the same prompts; the pooled figures are the sums of the passes'; outputs
    identical in every round, and plain's against its own first round counted."""
    record_path = tmp_path / "record.json"
    code = cli_main(["--log-level", "WARNING", "bench", "spec", "--model", tiny_model_dir, "--dataset", "random",
                     "--num-prompts", "6", "--concurrency", "6", "--input-len", "20", "--output-len", "16",
                     "--ignore-eos", "--rounds", "2", "--repeat-prompts", "--no-enable-prefix-caching",
                     "--dtype", "float32", "--kv-cache-memory-gb", "0.01",
                     "--speculative-config", json.dumps(NGRAM), "--output-json", str(record_path)])
    assert code == 0
    assert "per round: plain" in capsys.readouterr().out
    record = json.loads(record_path.read_text())
    assert record["workload"]["rounds"] == 2 and record["outputs_identical"] is True
    assert len(record["speedup_per_round"]) == 2 and record["requests_differing_per_round"] == [0, 0]
    assert record["plain_requests_differing_from_round_1"][0] == 0  # the control: plain against itself
    for name in ("plain", "speculative"):
        pooled = record[name]
        assert len(pooled["passes"]) == 2 and pooled["output_tokens"] == 2 * 6 * 16
        assert pooled["elapsed_s"] == sum(p["elapsed_s"] for p in pooled["passes"])
        assert pooled["draft_tokens"] == sum(p["draft_tokens"] for p in pooled["passes"])
    assert record["plain"]["draft_tokens"] == 0


def test_the_engine_core_times_both_regimes_for_the_policy(tiny_model_dir):
    """Adaptive speculation: the engine core feeds each step's busy time to the policy, which
    holds a measured plain and speculative step time at the batch size it ran (spec_cost.py)."""
    import math

    llm = tiny_llm(tiny_model_dir, speculative_config={**NGRAM, "max_step_tokens": 8})
    llm.generate(repetitive_prompts(2), GREEDY, use_tqdm=False)
    costs = llm.engine.scheduler.spec.costs
    measured = [size for i, size in enumerate(costs.sizes) if not any(math.isnan(x) for x in costs.seconds[:, i])]
    assert 2 in measured, costs.seconds  # two rows: padded size 2, both regimes
    assert 0 < costs.seconds[:, 1].min() and costs.seconds[:, 1].max() < 5
    assert llm.scheduler_stats()["spec_num_accepted_tokens"] > 0
    llm.shutdown()
