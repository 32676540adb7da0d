"""Where a decode step's device time goes, from a worker's profile window
(tokenmill/worker/device_profile.py writes it; `scripts/gpu_layouts.py --parts profile` reads it).

The device timeline is cut into steps at the marker kernel each profiled step starts with. Per
step: the device time of each kernel group, and the step's period (marker to marker) split into
busy time (the union of its events) and idle time. Idle time is split by gap length: gaps shorter
than `host_gap_us` are the device's own launch spacing between back-to-back kernels (inside a CUDA
graph, about a microsecond each); longer ones are waits on the host (its preparation of the step,
a read-back, the scheduler). The gap that holds the marker is the one between two steps.
"""

from __future__ import annotations

import re
from collections import defaultdict

# First match wins: the fused all-reduce + residual + RMSNorm counts as all-reduce.
GROUPS = (
    ("all_reduce", r"all_reduce|allreduce|one_shot|two_shot|nccl|symm"),
    ("attention", r"paged_attention|reduce_splits|flash|attention|fmha"),
    ("kv_write", r"write_kv|kv_write|reshape_and_cache"),
    ("act_quant", r"quantize_rows|quantize_groups|rms_norm_quant|silu_and_mul_quant"),  # fp8 activations
    ("gemm", r"gemm|gemv|cutlass|nvjet|xmma|sm90_|splitk|cublas|matmul|_linear|fp8_stream|int4_stream"),
    ("norm", r"rms_norm|layer_norm|norm_kernel"),
    ("rope", r"rotary|rope"),
    ("activation", r"silu|gelu|act_and_mul"),
    ("sampling", r"argmax|sample|topk|top_k|softmax|gumbel|exponential|multinomial|ArgMax|log_softmax"),
    ("copies", r"memcpy|memset|copy|index|gather|scatter|fill|embedding"),
    ("others", r".*"),
)


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return group
    return "others"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def analyze(record: dict, host_gap_us: float = 8.0, settle: int = 4) -> dict:
    """Per-step figures (means over the window's steps) from a rank's profile record. The first
    `settle` steps are left out where more than twice as many were profiled: starting the profiler
    on one rank can stall it long enough that its peer's first all-reduce waits for it."""
    marker = record.get("marker", "spin_kernel")
    events = sorted((e for e in record["events"]), key=lambda e: e[1])
    marks = [e for e in events if marker in e[0]]  # (the kernel's name: "...::spin_kernel(long)")
    if len(marks) > 2 * settle + 1:
        first = marks[settle][1]
        marks, events = marks[settle:], [e for e in events if e[1] >= first]
    kernels = [e for e in events if marker not in e[0]]
    if not kernels:
        raise ValueError("the profile holds no device events")
    end_of_all = max(e[1] + e[2] for e in kernels)
    if len(marks) >= 2:  # each step's work lies between the marker before it and its own
        bounds = [m[1] for m in marks]
        steps = len(marks) - 1
    else:  # CPU (smoke): no markers; the window as one span of `steps` steps
        bounds = [events[0][1], end_of_all]
        steps = max(int(record.get("steps", 1)), 1)
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    period = busy = launch_gaps = host_gaps = between = 0.0
    n_launch_gaps = n_host_gaps = 0
    largest: list[tuple[float, str, str]] = []
    for i in range(len(bounds) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        inside = [e for e in kernels if lo <= e[1] < hi]
        for name, _, dur in inside:
            per_name[name][0] += dur
            per_name[name][1] += 1
        period += hi - lo
        spans = _union([(e[1], e[1] + e[2]) for e in inside])
        busy += sum(b - a for a, b in spans)
        # The gap from the marker before the step to its first work, and from its last work to its
        # own marker: the turn between steps.
        edges = [lo] + [x for span in spans for x in span] + [hi]
        for j in range(0, len(edges) - 1, 2):
            gap = edges[j + 1] - edges[j]
            if j == 0 or j + 2 >= len(edges):
                between += gap
                continue
            if gap >= host_gap_us:
                host_gaps += gap
                n_host_gaps += 1
                before = next((e[0] for e in reversed(inside) if e[1] + e[2] <= edges[j] + 1e-3), "?")
                after = next((e[0] for e in inside if e[1] >= edges[j + 1] - 1e-3), "?")
                largest.append((gap, before[:80], after[:80]))
            else:
                launch_gaps += gap
                n_launch_gaps += 1
    groups: dict[str, float] = defaultdict(float)
    calls: dict[str, float] = defaultdict(float)
    for name, (us, count) in per_name.items():
        groups[group_of(name)] += us / steps
        calls[group_of(name)] += count / steps
    kernel_us = sum(groups.values())
    largest.sort(reverse=True)
    return {
        "rank": record.get("rank"), "steps": steps, "wall_ms_per_step": record.get("wall_ms_per_step"),
        "wall_ms_per_step_unprofiled": record.get("wall_ms_per_step_unprofiled"),
        "period_us": period / steps, "busy_us": busy / steps, "kernel_us": kernel_us,
        "kernels_per_step": sum(calls.values()),
        "idle_us": (period - busy) / steps,
        "launch_gaps_us": launch_gaps / steps, "launch_gaps_per_step": n_launch_gaps / steps,
        "host_gaps_us": host_gaps / steps, "host_gaps_per_step": n_host_gaps / steps,
        "between_steps_us": between / steps, "host_gap_threshold_us": host_gap_us,
        "groups_us": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
        "groups_calls": {g: calls[g] for g in sorted(groups, key=lambda g: -groups[g])},
        "largest_host_gaps": [{"us": g, "after": a, "before": b} for g, a, b in largest[:5]],
        "host_syncs": record.get("host_syncs"),
        "kernels": [{"name": n[:160], "us_per_step": us / steps, "calls_per_step": c / steps, "group": group_of(n)}
                    for n, (us, c) in sorted(per_name.items(), key=lambda kv: -kv[1][0])][:40],
    }


def format_report(label: str, a: dict, top: int = 25) -> str:
    lines = [f"{label} (rank {a['rank']}): {a['steps']} steps; wall {a['wall_ms_per_step'] or 0:.3f} ms/step "
             f"(unprofiled {a['wall_ms_per_step_unprofiled'] or 0:.3f}); device period {a['period_us'] / 1e3:.3f} ms "
             f"= kernels {a['kernel_us'] / 1e3:.3f} ({a['kernels_per_step']:.0f}/step) "
             f"+ idle {a['idle_us'] / 1e3:.3f} [launch gaps {a['launch_gaps_us'] / 1e3:.3f} "
             f"({a['launch_gaps_per_step']:.0f} < {a['host_gap_threshold_us']:.0f} us), "
             f"host gaps in the step {a['host_gaps_us'] / 1e3:.3f} ({a['host_gaps_per_step']:.1f}), "
             f"between steps {a['between_steps_us'] / 1e3:.3f}]",
             "groups: " + ", ".join(f"{g} {us:.0f} us x{a['groups_calls'][g]:.0f}" for g, us in a["groups_us"].items())]
    syncs = a.get("host_syncs")
    if syncs is not None:
        lines.append(f"host syncs in the window: {sum(syncs.values())}"
                     + "".join(f"\n  {n} x {where}" for where, n in sorted(syncs.items(), key=lambda kv: -kv[1])[:6]))
    for g in a["largest_host_gaps"][:3]:
        lines.append(f"  host gap {g['us']:.1f} us after {g['after']!r} before {g['before']!r}")
    lines.append(f"{'us/step':>9} {'calls':>6}  {'group':<10} kernel")
    for k in a["kernels"][:top]:
        lines.append(f"{k['us_per_step']:9.1f} {k['calls_per_step']:6.1f}  {k['group']:<10} {k['name'][:100]}")
    return "\n".join(lines)
