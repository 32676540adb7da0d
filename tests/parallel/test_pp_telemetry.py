"""`tokenmill bench throughput --pipeline-parallel-size 2` prints the pipeline's bubble fraction,
and its step trace shows two micro-batches in flight (the core submits a step before waiting for
the one before it), every step computed by both stages in order, stage 1 after stage 0.
Activation bytes between the stages are counted exactly. Counts and event order, not wall-clock
overlap: the machine may be busy."""

from __future__ import annotations

import json

import pytest

from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill.cli import main as cli_main

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, HIDDEN = 8, 32, 16, 256


@pytest.fixture(scope="module")
def wider_model(tmp_path_factory) -> str:
    """Still tiny, but with enough work per step that the stages' compute shows in the trace."""
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("pp-trace"), num_hidden_layers=4,
                               hidden_size=HIDDEN, intermediate_size=2 * HIDDEN)


def _events(trace: dict) -> dict[str, list[dict]]:
    """Process track name -> its complete events, in the order they were recorded (by start)."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    tracks: dict[str, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            tracks.setdefault(names[e["pid"]], []).append(e)
    for events in tracks.values():
        events.sort(key=lambda e: e["ts"])
    return tracks


def _track(tracks: dict[str, list[dict]], label: str) -> list[dict]:
    return next(v for k, v in tracks.items() if label in k)


def _in_flight_at_each_wait(core: list[dict]) -> list[int]:
    """The core's steps submitted and not yet applied when it starts waiting for each step.
    The core is one thread that records its phases in program order, so this is the count its
    queue held, whatever the machine's load."""
    counts, submitted, applied = [], 0, 0
    for e in core:
        if e["name"] == "submit":
            submitted += 1
        elif e["name"] == "wait":
            counts.append(submitted - applied)
        elif e["name"] == "update":
            applied += 1
    return counts


def test_bench_prints_bubble_and_trace_shows_overlap(wider_model, tmp_path, capsys) -> None:
    trace_path, record_path = tmp_path / "steps.json", tmp_path / "record.json"
    code = cli_main(["--log-level", "WARNING", "bench", "throughput", "--model", wider_model,
                     "--pipeline-parallel-size", "2", "--num-prompts", str(NUM_PROMPTS),
                     "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--ignore-eos",
                     "--dtype", "float32", "--kv-cache-memory-gb", "0.01", "--warmup", "0",
                     "--trace-steps", str(trace_path), "--output-json", str(record_path)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "bubble fraction (mean over stages)" in printed

    pipeline = json.loads(record_path.read_text())["tokenmill"]["pipeline"]
    first, last = pipeline["stages"]
    assert first["busy_s"] > 0 and last["busy_s"] > 0 and first["steps"] == last["steps"] > 0
    assert 0.0 <= pipeline["bubble_fraction"] < 1.0
    # Every computed token's hidden state (float32) crosses once: the prompts, and every output
    # token but the last (which is sampled, never fed back).
    tokens = NUM_PROMPTS * (INPUT_LEN + OUTPUT_LEN - 1)
    assert first["bytes_sent"] == tokens * HIDDEN * 4 and last["bytes_sent"] == 0

    tracks = _events(json.loads(trace_path.read_text()))
    core = _track(tracks, "core")
    stages = [[e["args"]["step"] for e in _track(tracks, f"pp stage {i}") if e["name"] == "stage_compute"]
              for i in range(2)]
    submitted = [e["args"]["step"] for e in core if e["name"] == "submit"]
    # Each stage computes every step with rows once, in the order the core submitted them.
    assert stages[0] == stages[1] == sorted(set(stages[0])) and set(stages[0]) <= set(submitted), (stages, submitted)
    assert len(stages[0]) >= OUTPUT_LEN, stages
    # Two micro-batches in flight: the core submits the next step before it waits for the
    # previous one, so stage 0 has the next one while stage 1 computes (with one batch at a time,
    # never). Counted on the core's queue, not inferred from wall-clock overlap on a busy machine.
    in_flight = _in_flight_at_each_wait(core)
    assert sum(n >= 2 for n in in_flight) >= 3, in_flight
    # A stage starts a step only after the stage before it ended it (the activations cross).
    # The timestamps are CLOCK_MONOTONIC in every process; this is causal order, not a duration.
    ends0 = {e["args"]["step"]: e["ts"] + e["dur"] for e in _track(tracks, "pp stage 0") if e["name"] == "stage_compute"}
    assert all(e["ts"] >= ends0[e["args"]["step"]] for e in _track(tracks, "pp stage 1") if e["name"] == "stage_compute")
    # Each stage's device work is a `device_step` span per step (rows and tokens named), in the
    # same causal order; the bubble's causes (benchmarks/pipeline_trace) add up to each stage's idle time.
    device = [{e["args"]["step"]: e for e in _track(tracks, f"pp stage {i}") if e["name"] == "device_step"}
              for i in range(2)]
    assert set(device[0]) == set(device[1]) == set(stages[0]), device
    for step, e in device[1].items():
        before = device[0][step]
        assert e["ts"] >= before["ts"] + before["dur"] and e["args"]["tokens"] == before["args"]["tokens"] >= 1
    from tokenmill.benchmarks.pipeline_trace import analyze
    figures = analyze(json.loads(trace_path.read_text()))
    for s in figures["stages"]:
        assert s["steps"] == len(stages[0]) and sum(s["idle_causes_ms"].values()) == pytest.approx(s["idle_ms"])
