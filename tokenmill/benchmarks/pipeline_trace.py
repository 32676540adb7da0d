"""Where a pipeline's bubble comes from, read off a step trace (`--trace-steps`).

Each stage's device work per step is a `device_step` span on the host clock (TP rank 0 of each
stage; `worker/device_idle.py`), with the step's rows, tokens and decode rows.

The bubble (issue 25's figure, goal < 3%) is the devices' idle time in the pipeline's steady
state: the window from the last stage's first step start (every stage has work: the fill is
over) to the first stage's last step end (no stage has run out: the drain has not begun). Per
stage: its idle time in that window over the window; the run's bubble is the mean over stages
(idle device time over all devices' time). Fill and drain are left out of it and reported apart;
the whole run's figure (`bubble_fraction`, from the first stage's first step to the last stage's
last, fill and drain included) is printed beside it. In the steady window each stage's idle
splits into `behind_busiest` (the busiest stage's busy time minus its own: the idle the
partition's imbalance forces, since every micro-batch passes every stage) and the rest, which
equals the busiest stage's own idle (stalls that hold back the whole pipeline); and, gap by gap,
into the causes below.

Over the window from the first stage's first step to the last stage's last step:

  busy / bubble   per stage: the device's time in steps, and the rest of the window;
  idle causes     each idle gap of a stage split by what it waited for:
                  `fill` / `drain` (before its first / after its last step: the pipeline filling
                  and emptying), `upstream` (a later stage waiting for the previous stage to finish
                  that step), `host` (the first stage waiting for the core to submit the step:
                  results coming back, scheduling, the step's message), `tokens` (the first stage
                  waiting for the last stage's sampled tokens, device tokens on: the span's
                  `tokens_upto` step ending on the last stage came last), `launch` (the step was there
                  but its device work had not started: the worker's preparation and, on a later
                  stage, receiving the activations);
  step times      per stage, the median device time of decode-only steps (every row one token) and
                  of steps with prompt tokens, and the slowest over the fastest stage per step kind:
                  the stages' imbalance;
  micro-batches   the spread of consecutive steps' tokens and last-stage times (equal work per
                  micro-batch keeps every stage busy);
  phases          the run cut where the first stage's last step with prompt tokens ends on the
                  last stage: each part's length and each stage's busy fraction in it (the
                  busiest stage bounds that part: which one, prompt chunks or decode);
  core            the core's time waiting for results, updating and scheduling;
  partition       given the run's partition, the split its own stage times argue for: a layer's
                  and the head's cost per step kind from the median stage times
                  (`stage_balance.costs_from_stage_times`), weighed by the kinds' step counts
                  (`stage_balance.balanced_for_mix`), and the decode steps' alone.

The trace's host-clock spans (the core's `submit`, `wait`, `update`) line up with the device spans
because every process uses CLOCK_MONOTONIC and CUDA events are anchored to it once per worker.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable

from tokenmill.distributed.stage_balance import balanced_for_mix, costs_from_stage_times


SPIKE_MS = 3.0  # a host span longer than this is a stall worth counting (steady ones take ~0.1-1 ms)
HOST_SPANS = ("schedule", "update", "submit", "prepare", "decode", "readback", "sample", "send")


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def tracks(trace: dict) -> dict[str, list[dict]]:
    """Process label -> its complete events, by start time."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    out: dict[str, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            out.setdefault(names.get(e["pid"], str(e["pid"])), []).append(e)
    for events in out.values():
        events.sort(key=lambda e: e["ts"])
    return out


def stage_spans(by_track: dict[str, list[dict]]) -> list[list[tuple[float, float, dict]]]:
    """Per stage (TP rank 0's track), its named device steps as (start us, end us, args)."""
    stages = []
    while True:
        label = next((k for k in by_track if f"pp stage {len(stages)}, tp rank 0" in k), None)
        if label is None:
            return stages
        stages.append([(e["ts"], e["ts"] + e["dur"], e.get("args") or {}) for e in by_track[label]
                       if e["name"] == "device_step" and "step" in (e.get("args") or {})])


def run_phases(trace: dict) -> dict:
    """Any engine's trace (one GPU or a pipeline): the run cut where the last step with prompt
    tokens ends on the last (or only) worker's device. Per part, its wall time in ms and steps,
    so that two layouts compare phase by phase (where the prompt chunks' or the decode steps'
    speed-up falls short); {} without device spans."""
    by_track = tracks(trace)
    stages = stage_spans(by_track)
    if stages and all(stages):
        first, last = stages[0], stages[-1]
    else:
        worker = next((v for k, v in by_track.items() if k.startswith("worker0")), [])
        first = last = [(e["ts"], e["ts"] + e["dur"], e.get("args") or {}) for e in worker
                        if e["name"] == "device_step" and "step" in (e.get("args") or {})]
    if not last:
        return {}
    begin, end = first[0][0], last[-1][1]
    prompt_ends = [e for _, e, a in last if _kind(a) == "prompt"]
    cut = max(prompt_ends) if prompt_ends else begin
    return {"prompt": {"ms": (cut - begin) / 1e3, "steps": sum(1 for s, _, _ in last if s < cut)},
            "decode": {"ms": (end - cut) / 1e3, "steps": sum(1 for s, _, _ in last if s >= cut)},
            "window_ms": (end - begin) / 1e3}


def _median(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def _kind(args: dict) -> str:
    return "decode" if args.get("tokens") == args.get("rows") else "prompt"


def analyze(trace: dict) -> dict:
    """The figures above (times in ms, fractions of the window); {} when no stage has device spans."""
    by_track = tracks(trace)
    stages = stage_spans(by_track)
    if not stages or not all(stages):
        return {}
    core = next((v for k, v in by_track.items() if k.startswith("core")), [])
    submitted = {e["args"]["step"]: e["ts"] + e["dur"] for e in core if e["name"] == "submit" and e.get("args")}
    begin = min(s[0][0] for s in stages)
    end = max(s[-1][1] for s in stages)
    window = end - begin
    ends = [{a["step"]: e for _, e, a in spans} for spans in stages]
    # The steady state: every stage has started and none has finished (see the module doc).
    steady_begin, steady_end = max(s[0][0] for s in stages), min(s[-1][1] for s in stages)
    steady = max(0.0, steady_end - steady_begin)

    def clip(a: float, b: float) -> float:  # the part of [a, b] inside the steady window
        return max(0.0, min(b, steady_end) - max(a, steady_begin))

    figures = {"window_ms": window / 1e3, "stages": [], "num_stages": len(stages),
               "steady_window_ms": steady / 1e3, "steady_begin_ms": (steady_begin - begin) / 1e3}
    for index, spans in enumerate(stages):
        causes = dict(fill=spans[0][0] - begin, drain=end - spans[-1][1], upstream=0.0, host=0.0, tokens=0.0,
                      launch=0.0)
        steady_causes = dict(upstream=0.0, host=0.0, tokens=0.0, launch=0.0)
        for (_, prev_end, _), (start, _, args) in zip(spans, spans[1:]):
            gap = max(0.0, start - prev_end)
            if index > 0:  # waiting for the previous stage's device to finish this step
                cause, ready = "upstream", ends[index - 1].get(args["step"], prev_end)
            else:  # waiting for the core to submit it, or for the last stage's tokens
                cause, ready = "host", submitted.get(args["step"], prev_end)
                tokens_at = ends[-1].get(args.get("tokens_upto"), prev_end)
                if tokens_at > ready:
                    cause, ready = "tokens", tokens_at
            waited = min(gap, max(0.0, ready - prev_end))
            causes[cause] += waited
            causes["launch"] += gap - waited
            steady_causes[cause] += clip(prev_end, prev_end + waited)
            steady_causes["launch"] += clip(prev_end + waited, start)
        busy = sum(e - s for s, e, _ in spans)
        steady_busy = sum(clip(s, e) for s, e, _ in spans)
        kinds = {}
        for kind in ("decode", "prompt"):
            times = [(e - s) / 1e3 for s, e, a in spans if _kind(a) == kind]
            kinds[kind] = {"steps": len(times), "median_ms": _median(times), "total_ms": sum(times)}
        between = window - causes["fill"] - causes["drain"]  # from its first step to its last
        figures["stages"].append({
            "stage": index, "steps": len(spans), "busy_ms": busy / 1e3, "idle_ms": (window - busy) / 1e3,
            "bubble_fraction": (window - busy) / window if window > 0 else 0.0,
            "bubble_between_steps_fraction": (between - busy) / between if between > 0 else 0.0,
            "idle_causes_ms": {k: v / 1e3 for k, v in causes.items()},
            "steady": {"busy_ms": steady_busy / 1e3, "idle_ms": (steady - steady_busy) / 1e3,
                       "bubble_fraction": (steady - steady_busy) / steady if steady > 0 else 0.0,
                       "idle_causes_ms": {k: v / 1e3 for k, v in steady_causes.items()}},
            "by_kind": kinds})
    busiest = max(s["steady"]["busy_ms"] for s in figures["stages"])
    for s in figures["stages"]:
        s["steady"]["behind_busiest_ms"] = busiest - s["steady"]["busy_ms"]
    # The stages' imbalance: per step kind, the slowest stage's median step time over the fastest's.
    imbalance = {}
    for kind in ("decode", "prompt"):
        medians = [s["by_kind"][kind]["median_ms"] for s in figures["stages"]]
        if all(m for m in medians):
            imbalance[kind] = {"stage_median_ms": medians, "slowest_over_fastest": max(medians) / min(medians)}
    figures["imbalance"] = imbalance
    # Consecutive micro-batches' work: the relative spread of their tokens and last-stage times.
    last = stages[-1]
    tokens = [a.get("tokens", 0) for _, _, a in last]
    times = [e - s for s, e, _ in last]

    def spread(values: list[float]) -> float | None:
        pairs = [abs(a - b) / max(a, b) for a, b in zip(values, values[1:]) if max(a, b) > 0]
        return _median(pairs)

    figures["micro_batches"] = {"consecutive_token_spread_p50": spread(tokens),
                                "consecutive_time_spread_p50": spread(times),
                                "decode_rows_p50": _median(a.get("decode_rows", 0) for _, _, a in last),
                                "tokens_p50": _median(tokens)}
    figures["phases"] = _phases(stages, begin, end)
    core_ms = {}
    for name in ("wait", "update", "schedule", "submit"):
        spans = [e for e in core if e["name"] == name and begin <= e["ts"] <= end]
        core_ms[name] = sum(e["dur"] for e in spans) / 1e3
    figures["core_ms"] = core_ms
    figures["host_pauses"] = host_pauses(by_track, begin, end)
    figures["bubble_fraction"] = statistics.mean(s["bubble_fraction"] for s in figures["stages"])
    figures["bubble_between_steps_fraction"] = statistics.mean(
        s["bubble_between_steps_fraction"] for s in figures["stages"])
    figures["bubble_steady_fraction"] = statistics.mean(s["steady"]["bubble_fraction"] for s in figures["stages"])
    return figures


def host_pauses(by_track: dict[str, list[dict]], begin: float, end: float, spike_ms: float = SPIKE_MS) -> dict:
    """Per process (the core and each worker), within the run: its garbage collections (`gc`
    events, `metrics/gc_pauses.py`: count, full ones, total and longest ms) and its host spans
    (`schedule`, `prepare`, ...) longer than `spike_ms`, by name: the stalls a closed pipeline
    loop passes on to every stage."""
    out = {}
    for label, events in by_track.items():
        if not (label.startswith("core") or "rank" in label):
            continue
        inside = [e for e in events if begin <= e["ts"] <= end]
        gcs = [e for e in inside if e["name"] == "gc"]
        spikes: dict[str, int] = {}
        for e in inside:
            if e["name"] in HOST_SPANS and e["dur"] > spike_ms * 1e3:
                spikes[e["name"]] = spikes.get(e["name"], 0) + 1
        out[label] = {"gc_count": len(gcs),
                      "gc_full": sum(1 for e in gcs if (e.get("args") or {}).get("generation") == 2),
                      "gc_ms": sum(e["dur"] for e in gcs) / 1e3,
                      "gc_max_ms": max((e["dur"] for e in gcs), default=0.0) / 1e3,
                      "spikes": spikes}
    return out


def _phases(stages: list[list[tuple[float, float, dict]]], begin: float, end: float) -> dict:
    """The run cut where the first stage's last step with prompt tokens ends on the last stage:
    per part, its length and each stage's busy fraction within it (the busiest bounds the part)."""
    prompts = [a["step"] for _, _, a in stages[0] if _kind(a) == "prompt"]
    last_end = {a["step"]: e for _, e, a in stages[-1]}
    cut = last_end.get(prompts[-1], begin) if prompts else begin
    out = {}
    for name, (a, b) in (("prompt", (begin, cut)), ("decode", (cut, end))):
        if b <= a:
            continue
        busy = [sum(max(0.0, min(e, b) - max(s, a)) for s, e, _ in spans) / (b - a) for spans in stages]
        out[name] = {"window_ms": (b - a) / 1e3, "busy_fraction": busy}
    return out


def suggest_partition(figures: dict, partition: tuple[int, ...]) -> dict:
    """The split the run's stage times argue for (see the module doc); {} without step kinds
    measured on every stage."""
    phases, per_kind = [], {}
    for kind in ("decode", "prompt"):
        medians = [s["by_kind"][kind]["median_ms"] for s in figures.get("stages", [])]
        if len(medians) != len(partition) or not all(medians):
            continue
        costs = costs_from_stage_times(medians, partition)
        steps = figures["stages"][-1]["by_kind"][kind]["steps"]
        phases.append((steps, costs))
        per_kind[kind] = {"layer_ms": costs.layers[0], "head_ms": costs.head, "steps": steps}
    if not phases:
        return {}
    out = {"run": list(partition), "kinds": per_kind, "mix": list(balanced_for_mix(phases, len(partition)))}
    if "decode" in per_kind:
        out["decode"] = list(balanced_for_mix(phases[:1], len(partition)))
    return out


def format_report(label: str, figures: dict) -> str:
    if not figures:
        return f"{label}: no device_step spans in the trace"
    steady = figures.get("bubble_steady_fraction")
    lines = [f"{label}: pipeline from the step trace: BUBBLE {steady:.1%} in the steady state (mean over stages "
             f"of device idle / the {figures['steady_window_ms'] / 1e3:.2f} s from the last stage's first step to "
             f"the first stage's last; goal < 3%); {figures['bubble_fraction']:.1%} over the whole "
             f"{figures['window_ms'] / 1e3:.2f} s run with fill and drain; "
             f"{figures['bubble_between_steps_fraction']:.1%} each stage from its first step to its last",
             "  steady: stage  busy s  bubble  idle ms = behind busiest + its own stalls | its gaps by cause, ms: "
             "upstream  host tokens launch",
             ]
    for s in figures["stages"]:
        st = s["steady"]
        c = st["idle_causes_ms"]
        lines.append(f"  {s['stage']:>13} {st['busy_ms'] / 1e3:7.2f} {st['bubble_fraction']:7.1%} "
                     f"{st['idle_ms']:8.0f} = {st['behind_busiest_ms']:13.0f} + "
                     f"{st['idle_ms'] - st['behind_busiest_ms']:14.0f} | {c['upstream']:27.0f} {c['host']:5.0f} "
                     f"{c['tokens']:6.0f} {c['launch']:6.0f}")
    lines.append("  whole: stage steps  busy s  bubble |  idle ms: fill  drain upstream  host tokens  launch | "
                 "step ms p50: decode  prompt")
    for s in figures["stages"]:
        c, k = s["idle_causes_ms"], s["by_kind"]
        lines.append(f"  {s['stage']:>12} {s['steps']:>5} {s['busy_ms'] / 1e3:7.2f} {s['bubble_fraction']:7.1%} | "
                     f"{c['fill']:12.0f} {c['drain']:6.0f} {c['upstream']:8.0f} {c['host']:5.0f} {c['tokens']:6.0f} "
                     f"{c['launch']:7.0f} | {k['decode']['median_ms'] or 0:18.3f} {k['prompt']['median_ms'] or 0:7.3f}")
    for kind, im in figures["imbalance"].items():
        lines.append(f"  {kind} steps: slowest stage {im['slowest_over_fastest']:.3f}x the fastest "
                     f"(p50 {' / '.join(f'{m:.3f}' for m in im['stage_median_ms'])} ms)")
    mb = figures["micro_batches"]
    lines.append(f"  consecutive micro-batches differ by {mb['consecutive_token_spread_p50'] or 0:.1%} in tokens, "
                 f"{mb['consecutive_time_spread_p50'] or 0:.1%} in last-stage time (p50); "
                 f"{mb['tokens_p50'] or 0:.0f} tokens, {mb['decode_rows_p50'] or 0:.0f} decode rows per step (p50)")
    phases = figures.get("phases") or {}
    if phases:
        lines.append("  phases (to the last prompt step, then decode): " + "; ".join(
            f"{k} {v['window_ms'] / 1e3:.2f} s, stages busy {' / '.join(f'{b:.1%}' for b in v['busy_fraction'])}"
            for k, v in phases.items()))
    core = figures["core_ms"]
    lines.append("  core: " + ", ".join(f"{k} {v / 1e3:.2f} s" for k, v in core.items()))
    for name, p in (figures.get("host_pauses") or {}).items():
        spikes = ", ".join(f"{k} {v}" for k, v in sorted(p["spikes"].items())) or "none"
        lines.append(f"  {name}: gc {p['gc_count']} collections ({p['gc_full']} full), {p['gc_ms']:.1f} ms, "
                     f"longest {p['gc_max_ms']:.1f} ms; host spans over {SPIKE_MS:g} ms: {spikes}")
    split = figures.get("partition")
    if split:
        kinds = "; ".join(f"{k}: a layer {v['layer_ms']:.3f} ms, head {v['head_ms']:.3f} ms ({v['steps']} steps)"
                          for k, v in split["kinds"].items())
        lines.append(f"  partition {','.join(map(str, split['run']))}: its stage times argue for "
                     f"{','.join(map(str, split['mix']))} (decode steps alone: "
                     f"{','.join(map(str, split.get('decode') or []))}); {kinds}")
    return "\n".join(lines)
