"""`tokenmill bench serve` against the shared server: table, JSON record and plot."""

from __future__ import annotations

import json
import random

from tokenmill.benchmarks.serve import RequestResult, arrival_delays, summarize
from tokenmill.cli import main


def test_poisson_gaps_and_summary() -> None:
    gaps = arrival_delays(4000, 50.0, random.Random(0))
    assert abs(sum(gaps) / len(gaps) - 1 / 50.0) < 0.002
    assert arrival_delays(3, float("inf"), random.Random(0)) == [0.0, 0.0, 0.0]
    results = [RequestResult(True, latency=1.0, ttft=0.1, itl=[0.3, 0.3, 0.3], output_tokens=4, prompt_tokens=2),
               RequestResult(False, error="HTTP 503")]
    s = summarize(results, 2.0)
    assert s["completed"] == 1 and s["failed"] == 1 and s["errors"] == ["HTTP 503"]
    assert s["output_token_throughput"] == 2.0 and s["total_token_throughput"] == 3.0
    assert abs(s["tpot_ms"]["mean"] - 300.0) < 1e-6 and abs(s["ttft_ms"]["p50"] - 100.0) < 1e-6


def test_bench_serve_end_to_end(server, tmp_path, capsys) -> None:
    record_path, plot_path = tmp_path / "record.json", tmp_path / "latency.png"
    code = main(["bench", "serve", "--base-url", server.base_url, "--api-key", server.api_key,
                 "--num-prompts", "6", "--input-len", "6", "--output-len", "4", "--ignore-eos",
                 "--request-rate", "20", "50", "--max-concurrency", "4",
                 "--output-json", str(record_path), "--plot", str(plot_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "Successful requests:" in out and "TTFT (ms)" in out
    assert "speculative decoding" not in out  # the shared server does not speculate
    record = json.loads(record_path.read_text())
    assert record["machine"] and record["versions"]["tokenmill"]
    assert [r["request_rate"] for r in record["runs"]] == [20.0, 50.0]
    for run in record["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0 and run["total_output_tokens"] == 24
        assert set(run["itl_ms"]) == {"mean", "p50", "p90", "p99"}
        assert "speculative_decoding" not in run
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert plot_path.stat().st_size > 1000
