"""What each kernel adds to a decode step's device time, from a worker's profile window
(tokenmill/worker/device_profile.py), when kernels overlap.

Under programmatic dependent launch (`triton_ops.pdl`) a kernel starts while the one before it is
still running (it streams weights, then waits), so its profiled duration holds the wait and the
durations of a step's kernels sum to more than the step. Here each kernel is charged only what it
adds to the step: walking the step's kernels in start order, the part of its interval past the
latest end seen so far (`adds_us`; the charges sum to the step's busy time), and the idle time
between that latest end and its start (`gap_before_us`; with the charges, the step's period less
the turn between steps).

A kernel name that runs several times a step is split into slots by its order in the step: with
`layers` decoder layers and c calls, the first c // layers * layers calls take slots 0 .. c //
layers - 1 in turn (a GEMV's qkv / o / gate_up / down) and the calls after them `tail0`, `tail1`
(the LM head's GEMV, the final norm).
"""

from __future__ import annotations

from collections import defaultdict


def _steps(record: dict) -> list[list[tuple[str, float, float]]]:
    """The kernels of each step between consecutive markers (the marker excluded)."""
    marker = record.get("marker", "spin_kernel")
    events = sorted(record["events"], key=lambda e: e[1])
    marks = [e[1] for e in events if marker in e[0]]
    steps = []
    for lo, hi in zip(marks, marks[1:]):
        steps.append([(e[0], e[1], e[2]) for e in events if lo <= e[1] < hi and marker not in e[0]])
    return [s for s in steps if s]


def _slot(index: int, calls: int, layers: int) -> str:
    per_layer = calls // layers if layers and calls >= layers else 0
    if per_layer and index < per_layer * layers:
        return str(index % per_layer)
    return f"tail{index - per_layer * layers}"


def attribute(record: dict, layers: int, short: int = 48) -> dict:
    """Per (kernel, slot), means per step: calls, profiled duration, what it adds and the gap
    before it; and the step's sums. `short`: characters of a kernel's name kept."""
    steps = _steps(record)
    if not steps:
        raise ValueError("the profile holds fewer than two markers: no whole step")
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])  # calls, dur, adds, gap
    busy = gaps = 0.0
    for kernels in steps:
        counts: dict[str, int] = defaultdict(int)
        for name, _, _ in kernels:
            counts[name] += 1
        seen: dict[str, int] = defaultdict(int)
        latest = kernels[0][1]
        for name, start, dur in kernels:
            key = f"{name[:short]}[{_slot(seen[name], counts[name], layers)}]"
            seen[name] += 1
            end = start + dur
            gap = max(start - latest, 0.0)
            adds = max(end - max(start, latest), 0.0)
            row = rows[key]
            row[0] += 1
            row[1] += dur
            row[2] += adds
            row[3] += gap
            busy += adds
            gaps += gap
            latest = max(latest, end)
    n = len(steps)
    table = [{"kernel": k, "calls": c / n, "dur_us": d / n, "adds_us": a / n, "gap_before_us": g / n}
             for k, (c, d, a, g) in sorted(rows.items(), key=lambda kv: -(kv[1][2] + kv[1][3]))]
    return {"steps": n, "busy_us": busy / n, "gaps_us": gaps / n, "kernels": table}


def format_table(a: dict, top: int = 30) -> str:
    lines = [f"{a['steps']} steps: busy {a['busy_us']:.1f} us + gaps inside the step {a['gaps_us']:.1f} us per step",
             f"{'adds us':>8} {'gap us':>7} {'dur us':>8} {'calls':>6}  kernel[slot]"]
    for r in a["kernels"][:top]:
        lines.append(f"{r['adds_us']:8.1f} {r['gap_before_us']:7.1f} {r['dur_us']:8.1f} {r['calls']:6.1f}  {r['kernel']}")
    return "\n".join(lines)
