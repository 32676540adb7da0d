"""`benchmarks/pipeline_trace`: a pipeline's bubble split by cause, on a hand-made step trace whose
every gap is known (times in microseconds, as Chrome traces have them)."""

from __future__ import annotations

import pytest

from tokenmill.benchmarks.pipeline_trace import analyze, format_report


def _trace(stage_steps: list[list[tuple[int, float, float, int]]], submits: dict[int, float]) -> dict:
    """stage_steps[s]: (step, start, end, tokens) of stage s (rows: 4 each); submits: step -> the
    core's submit end."""
    events = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "core (pid 9)"}}]
    for step, end in submits.items():
        events.append({"name": "submit", "ph": "X", "pid": 1, "tid": 1, "ts": end - 0.5, "dur": 0.5,
                       "args": {"step": step}})
    for s, steps in enumerate(stage_steps):
        pid = 2 + s
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": f"worker{s}: pp stage {s}, tp rank 0 (pid {pid})"}})
        for step, start, end, tokens in steps:
            events.append({"name": "device_step", "ph": "X", "pid": pid, "tid": 1, "ts": start, "dur": end - start,
                           "args": {"step": step, "rows": 4, "tokens": tokens, "decode_rows": 4 if tokens == 4 else 3}})
            events.append({"name": "prepare", "ph": "X", "pid": pid, "tid": 1, "ts": start, "dur": 0.1})
    return {"traceEvents": events}


def test_every_idle_gap_gets_its_cause() -> None:
    # Stage 0 waits 5 before step 3: the core submitted it 3 after stage 0 went idle (host), and
    # the device started 2 later (launch). Stage 1 waits 3 before step 3: stage 0 finished it 2
    # after stage 1 went idle (upstream), then 1 more (launch). Fill: stage 1 starts at 11;
    # drain: stage 0 ends 11 before the window does.
    trace = _trace([[(1, 0, 10, 4), (2, 10, 20, 4), (3, 25, 35, 40)],
                    [(1, 11, 22, 4), (2, 22, 33, 4), (3, 36, 46, 40)]],
                   submits={1: -1.0, 2: 5.0, 3: 23.0})
    f = analyze(trace)
    assert f["window_ms"] == pytest.approx(46e-3)
    first, last = f["stages"]
    assert first["busy_ms"] == pytest.approx(30e-3) and last["busy_ms"] == pytest.approx(32e-3)
    assert first["idle_causes_ms"] == pytest.approx(dict(fill=0, drain=11e-3, upstream=0, host=3e-3, tokens=0,
                                                         launch=2e-3))
    assert last["idle_causes_ms"] == pytest.approx(dict(fill=11e-3, drain=0, upstream=2e-3, host=0, tokens=0,
                                                        launch=1e-3))
    # Without fill and drain: stage 0 idles 5 of its 35 (first step to last), stage 1 3 of 35.
    assert first["bubble_between_steps_fraction"] == pytest.approx(5 / 35)
    assert last["bubble_between_steps_fraction"] == pytest.approx(3 / 35)
    for s in f["stages"]:  # the causes account for the whole bubble
        assert sum(s["idle_causes_ms"].values()) == pytest.approx(s["idle_ms"])
        assert s["bubble_fraction"] == pytest.approx(s["idle_ms"] / f["window_ms"])
    # Per step kind: stage 1's decode steps take 11 where stage 0's take 10.
    assert f["imbalance"]["decode"]["slowest_over_fastest"] == pytest.approx(1.1)
    assert f["stages"][0]["by_kind"]["prompt"]["steps"] == 1
    assert f["micro_batches"]["tokens_p50"] == 4
    assert "bubble" in format_report("pp2", f)


def test_the_first_stage_waits_for_the_last_stages_tokens() -> None:
    # Device tokens: step 3 (submitted at 12) needs step 1's tokens, which the last stage's step 1
    # has at 22: stage 0's gap 20 -> 25 is 2 of tokens (22 - 20) and 3 of launch.
    trace = _trace([[(1, 0, 10, 4), (2, 10, 20, 4), (3, 25, 35, 4)],
                    [(1, 11, 22, 4), (2, 22, 33, 4), (3, 36, 46, 4)]],
                   submits={1: -1.0, 2: 5.0, 3: 12.0})
    for e in trace["traceEvents"]:
        if e["name"] == "device_step" and e["args"]["step"] == 3:
            e["args"]["tokens_upto"] = 1
    causes = analyze(trace)["stages"][0]["idle_causes_ms"]
    assert causes["tokens"] == pytest.approx(2e-3) and causes["host"] == 0 and causes["launch"] == pytest.approx(3e-3)


def test_no_device_spans_no_figures() -> None:
    assert analyze({"traceEvents": []}) == {}


def test_the_run_argues_for_a_split() -> None:
    from tokenmill.benchmarks.pipeline_trace import suggest_partition
    # 8 layers split 4/4: stage 0's decode steps take 4 (a layer is 1), stage 1's 5.5 (a head
    # of 1.5): 5/3 evens them (5 against 4.5); the prompt steps (equal stages) argue for 4/4.
    decode = [[(i, 10.0 * i, 10.0 * i + 4, 4) for i in range(1, 20)],
              [(i, 10.0 * i + 4, 10.0 * i + 9.5, 4) for i in range(1, 20)]]
    f = analyze(_trace(decode, {}))
    split = suggest_partition(f, (4, 4))
    assert split["decode"] == split["mix"] == [5, 3]
    assert split["kinds"]["decode"]["head_ms"] == pytest.approx(1.5e-3)
    assert "argue for 5,3" in format_report("pp2", {**f, "partition": split})


def test_phases_say_which_stage_bounds_each_part() -> None:
    # Step 1 is a prompt chunk (40 tokens), ending on stage 1 at 20: the prompt part is [0, 20],
    # where stage 0 is busy 20 of 20 and stage 1 10; the decode part [20, 44], stage 0 busy 10
    # (step 3) of 24, stage 1 all of it.
    trace = _trace([[(1, 0, 10, 40), (2, 10, 20, 4), (3, 20, 30, 4)],
                    [(1, 10, 20, 40), (2, 20, 32, 4), (3, 32, 44, 4)]], submits={})
    f = analyze(trace)
    prompt, decode = f["phases"]["prompt"], f["phases"]["decode"]
    assert prompt["window_ms"] == pytest.approx(20e-3) and decode["window_ms"] == pytest.approx(24e-3)
    assert prompt["busy_fraction"] == pytest.approx([1.0, 0.5])
    assert decode["busy_fraction"] == pytest.approx([10 / 24, 1.0])
    assert "phases" in format_report("pp2", f)


def test_the_bubble_is_the_steady_states_idle_split_into_imbalance_and_stalls() -> None:
    # The steady state runs from stage 1's first step (11) to stage 0's last end (35): 24. Stage 0
    # is busy 9 + 10 there and waits 20 -> 25 (host 3, launch 2); stage 1 is busy 11 + 11 and
    # waits 33 -> 35 for stage 0's step 3 (upstream; its last 1 of launch falls in the drain).
    # Stage 1 is the busiest (22): stage 0's 5 idle is 3 behind it and 2 of stalls, which stage 1's
    # own 2 idle equals (a stall of the busiest holds back the whole pipeline).
    trace = _trace([[(1, 0, 10, 4), (2, 10, 20, 4), (3, 25, 35, 40)],
                    [(1, 11, 22, 4), (2, 22, 33, 4), (3, 36, 46, 40)]],
                   submits={1: -1.0, 2: 5.0, 3: 23.0})
    f = analyze(trace)
    assert f["steady_window_ms"] == pytest.approx(24e-3) and f["steady_begin_ms"] == pytest.approx(11e-3)
    first, last = (s["steady"] for s in f["stages"])
    assert first["busy_ms"] == pytest.approx(19e-3) and last["busy_ms"] == pytest.approx(22e-3)
    assert first["idle_causes_ms"] == pytest.approx(dict(upstream=0, host=3e-3, tokens=0, launch=2e-3))
    assert last["idle_causes_ms"] == pytest.approx(dict(upstream=2e-3, host=0, tokens=0, launch=0))
    assert first["behind_busiest_ms"] == pytest.approx(3e-3) and last["behind_busiest_ms"] == 0
    assert first["bubble_fraction"] == pytest.approx(5 / 24) and last["bubble_fraction"] == pytest.approx(2 / 24)
    assert f["bubble_steady_fraction"] == pytest.approx(7 / 48)
    for s in (first, last):  # the gaps' causes account for the steady idle
        assert sum(s["idle_causes_ms"].values()) == pytest.approx(s["idle_ms"])
    assert "BUBBLE 14.6% in the steady state" in format_report("pp2", f)


def test_host_pauses_count_collections_and_long_host_spans() -> None:
    # Stage 0's worker: a full collection of 6 and one of generation 1 inside the run, one after
    # it (not counted); its prepare spans: one of 0.1 (every step's) and one of 5 (a stall).
    trace = _trace([[(1, 0, 10, 4), (2, 10, 20, 4)], [(1, 11, 22, 4), (2, 22, 33, 4)]], submits={1: -1.0, 2: 5.0})
    worker0 = 2
    trace["traceEvents"] += [
        {"name": "gc", "ph": "X", "pid": worker0, "tid": 1, "ts": 3.0, "dur": 6e3, "args": {"generation": 2}},
        {"name": "gc", "ph": "X", "pid": worker0, "tid": 1, "ts": 4.0, "dur": 500.0, "args": {"generation": 1}},
        {"name": "gc", "ph": "X", "pid": worker0, "tid": 1, "ts": 90.0, "dur": 9e3, "args": {"generation": 2}},
        {"name": "prepare", "ph": "X", "pid": worker0, "tid": 1, "ts": 12.0, "dur": 5e3}]
    pauses = analyze(trace)["host_pauses"]
    stage0 = next(v for k, v in pauses.items() if k.startswith("worker0"))
    assert stage0["gc_count"] == 2 and stage0["gc_full"] == 1
    assert stage0["gc_ms"] == pytest.approx(6.5) and stage0["gc_max_ms"] == pytest.approx(6.0)
    assert stage0["spikes"] == {"prepare": 1}
    stage1 = next(v for k, v in pauses.items() if k.startswith("worker1"))
    assert stage1["gc_count"] == 0 and stage1["spikes"] == {}
    assert "longest 6.0 ms" in format_report("pp2", analyze(trace))


def test_run_phases_cut_a_pipeline_and_one_gpu_alike() -> None:
    from tokenmill.benchmarks.pipeline_trace import run_phases
    # Two stages: prompt steps (40 tokens) end on the last stage at 33; decode runs to 46.
    trace = _trace([[(1, 0, 10, 40), (2, 10, 20, 40), (3, 25, 35, 4)],
                    [(1, 11, 22, 40), (2, 22, 33, 40), (3, 36, 46, 4)]], submits={})
    phases = run_phases(trace)
    assert phases["prompt"] == {"ms": pytest.approx(33e-3), "steps": 2}
    assert phases["decode"] == {"ms": pytest.approx(13e-3), "steps": 1}
    # One GPU: its only worker's track (named without a stage).
    one = _trace([[(1, 0, 20, 40), (2, 20, 24, 4), (3, 25, 29, 4)]], submits={})
    for e in one["traceEvents"]:
        if e["name"] == "process_name" and e["pid"] == 2:
            e["args"]["name"] = "worker0 (pid 2)"
    phases = run_phases(one)
    assert phases["prompt"]["ms"] == pytest.approx(20e-3) and phases["decode"] == {"ms": pytest.approx(9e-3),
                                                                                    "steps": 2}
    assert run_phases({"traceEvents": []}) == {}
