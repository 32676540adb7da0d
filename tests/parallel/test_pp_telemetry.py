"""`tokenmill bench throughput --pipeline-parallel-size 2` prints the pipeline's bubble fraction,
and its step trace shows the two micro-batches overlapping: each stage computes one step while
the other stage computes another. Activation bytes between the stages are counted exactly."""

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


def _stage_compute_intervals(trace: dict) -> dict[str, list[tuple[float, float, int]]]:
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    spans: dict[str, list[tuple[float, float, int]]] = {}
    for e in trace["traceEvents"]:
        if e.get("name") == "stage_compute":
            spans.setdefault(names[e["pid"]], []).append((e["ts"], e["ts"] + e["dur"], e["args"]["step"]))
    return spans


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

    spans = _stage_compute_intervals(json.loads(trace_path.read_text()))
    stage0 = next(v for k, v in spans.items() if "pp stage 0" in k)
    stage1 = next(v for k, v in spans.items() if "pp stage 1" in k)
    assert sorted(s for _, _, s in stage0) == sorted(s for _, _, s in stage1)  # every step ran on both
    overlaps = [(a, b) for a in stage0 for b in stage1 if a[2] != b[2] and a[0] < b[1] and b[0] < a[1]]
    # Two micro-batches in flight: stage 0 computes one step while stage 1 computes another (with
    # one batch at a time, never). How often depends on the machine's load: ask for a few.
    assert len(overlaps) >= 3, f"{len(overlaps)} overlapping pairs in {len(stage0)} steps"
