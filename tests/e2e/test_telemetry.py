"""Message telemetry, step trace, debug digest, `bench overhead` and `bench core`, on the null model.

Steady decode must cost O(1) bytes per step from the scheduler to the workers and at most
~5 bytes per running request back. A block size larger than prompt + output keeps every
decode step free of new blocks, so the median step message is the steady one.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.engine import worker_runner
from tokenmill import LLM, SamplingParams
from tokenmill.protocol.digest import WorkerStateMismatchError
from tokenmill.cli import main as cli_main
from tokenmill.metrics.message_stats import merge_channels
from tokenmill.protocol import EngineCoreRequest, TelemetryReport, pack_ids

ENGINE = dict(load_format="null", block_size=128, max_num_seqs=256, debug_check_every=3)
DECODE = SamplingParams(max_tokens=100, ignore_eos=True)


@pytest.fixture(scope="module")
def traced(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "steps.json"
    llm = LLM(tiny_model, trace_steps=str(path), **ENGINE)
    yield llm, path
    llm.shutdown()


def _decode(llm: LLM, num_requests: int) -> TelemetryReport:
    llm.reset_telemetry()
    prompts = [{"prompt_token_ids": [10 + i % 200] * 8} for i in range(num_requests)]
    outs = llm.generate(prompts, DECODE, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == DECODE.max_tokens for o in outs)
    return llm.telemetry()


def _proc(report: TelemetryReport, role: str):
    return next(p for p in report.processes if p.role == role)


def _channel(report: TelemetryReport, name: str, *roles: str):
    return merge_channels(*(_proc(report, r).channels[name] for r in roles))


def test_steady_decode_bytes(traced) -> None:
    llm, _ = traced
    p50 = {}
    for n in (64, 256):
        report = _decode(llm, n)
        assert [p.role for p in report.processes] == ["frontend", "core", "worker0"]
        steps = _channel(report, "steps", "core", "worker0")
        results = _channel(report, "results", "core", "worker0")
        assert steps.count >= DECODE.max_tokens and results.count == steps.count
        assert steps.encode_us > 0 and steps.decode_us > 0 and results.encode_us > 0 and results.decode_us > 0
        assert steps.bytes_p50 <= 64, steps
        assert results.bytes_p50 <= 5 * n, results
        p50[n] = steps.bytes_p50
        fe, core = _proc(report, "frontend").channels, _proc(report, "core").channels
        assert fe["requests"].count == core["requests"].count == n
        # Both ends count the same messages, give or take those in flight at a snapshot.
        assert abs(fe["outputs"].count - core["outputs"].count) <= 2 and core["outputs"].count >= steps.count - 2
        assert fe["outputs"].bytes_p50 == core["outputs"].bytes_p50 > 0
        assert {"schedule", "submit", "wait", "update", "send_outputs"} <= _proc(report, "core").timings.keys()
        assert {"decode", "prepare", "sample", "encode", "device_idle"} <= _proc(report, "worker0").timings.keys()
    # Independent of the batch size: a few bytes of step id and of the occasional diff that lands
    # in the median under load; anything per request would add 192+ bytes at 256 rows.
    assert abs(p50[256] - p50[64]) <= 8, p50


def test_trace_has_every_process(traced) -> None:
    llm, path = traced
    llm.generate(["hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.shutdown()  # each process writes its part; the front-end merges them
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all({"name", "ts", "dur", "pid", "tid"} <= e.keys() for e in events)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert len({e["pid"] for e in events}) >= 3
    assert sorted(n.split()[0] for n in names.values()) == ["core", "frontend", "worker0"]
    assert {"schedule", "decode", "get_outputs"} <= {e["name"] for e in events}
    assert not list(path.parent.glob("steps.json.*"))  # the parts are merged and removed


@pytest.mark.parametrize("load_format", ["null", "auto"])
def test_digest_catches_corrupted_worker_view(tiny_model, load_format) -> None:
    llm = LLM(tiny_model, single_process=True, load_format=load_format, dtype="float32",
              kv_cache_memory_gb=0.01, debug_check_every=1)
    try:
        engine = llm.engine
        for handle in range(3):
            engine.add_request(EngineCoreRequest(handle, pack_ids([5 + handle] * 20), DECODE))
        for _ in range(3):
            engine.step()  # the check passes while the views agree
        runner = worker_runner(llm)
        if load_format == "null":
            runner.states[1].block_ids[0] += 1
        else:  # the persistent batch's host block table of request 1
            runner.batch.block_table[runner.batch.slot_of[1], 0] += 1
        with pytest.raises(WorkerStateMismatchError, match="debug check failed at step"):
            for _ in range(engine.max_in_flight):  # surfaces when its step's result is taken
                engine.step()
    finally:
        llm.shutdown()


def test_bench_overhead_end_to_end(tiny_model, tmp_path, capsys) -> None:
    out = tmp_path / "overhead.json"
    assert cli_main(["--log-level", "WARNING", "bench", "overhead", "--model", tiny_model, "--batch-sizes", "1,4",
                     "--steps", "5", "--warmup-steps", "2", "--output-json", str(out)]) == 0
    record = json.loads(out.read_text())
    rows = record["results"]
    assert [(r["async_scheduling"], r["batch_size"]) for r in rows] == [(False, 1), (False, 4), (True, 1), (True, 4)]
    for r in rows:
        assert r["core_steps_per_s"] > 0 and r["frontend_tokens_per_s"] > 0
        assert 0 < r["sched_to_worker_bytes_p50"] <= 64
        assert r["core_to_frontend_bytes_p50"] > 0 and r["core_us_per_step"] > 0
    assert "core st/s" in capsys.readouterr().out


def test_bench_core_runs_and_records(tiny_model, tmp_path, capsys) -> None:
    out = tmp_path / "core.json"
    assert cli_main(["--log-level", "WARNING", "bench", "core", "--model", tiny_model, "--batch-sizes", "1,8",
                     "--steps", "5", "--warmup-steps", "2", "--repeats", "1", "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["arrival"], r["async_scheduling"], r["batch_size"]) for r in rows] == [
        (arrival, mode, size) for arrival in ("aligned", "staggered") for mode in (False, True) for size in (1, 8)]
    assert all(r["schedule_us"] > 0 and r["update_us"] > 0 and r["worker_and_codecs_us"] > 0 for r in rows)
    assert "µs/request" in capsys.readouterr().out
