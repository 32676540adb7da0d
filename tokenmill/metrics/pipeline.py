"""Pipeline figures from a telemetry report: per stage, how long it worked, how long it sat idle
between steps (the bubble), and how many activation bytes it sent to the next stage.

Per stage the figures are TP rank 0's (its ranks work in lockstep). Busy and idle are the
worker's `device_step` and `device_idle` totals (CUDA events on GPU; on CPU the host clock
around each forward), so a stage waiting for the previous one's activations counts as idle.
bubble fraction = idle / (busy + idle), over the window since the telemetry was last reset.
"""

from __future__ import annotations

from tokenmill.config import ParallelConfig
from tokenmill.protocol import TelemetryReport


def pipeline_figures(report: TelemetryReport, parallel: ParallelConfig) -> dict:
    """{"stages": [per stage: busy_s, idle_s, bubble_fraction, steps, bytes_sent], "bubble_fraction": mean}."""
    by_role = {p.role: p for p in report.processes}
    tp = parallel.tensor_parallel_size
    stages = []
    for stage in range(parallel.pipeline_parallel_size):
        proc = by_role.get(f"worker{stage * tp}")
        if proc is None:
            continue
        busy = proc.timings.get("device_step")
        idle = proc.timings.get("device_idle")
        busy_s = busy.total_us / 1e6 if busy else 0.0
        idle_s = idle.total_us / 1e6 if idle else 0.0
        sent = sum(by_role[f"worker{stage * tp + r}"].channels.get("activations_sent").bytes_total
                   for r in range(tp) if f"worker{stage * tp + r}" in by_role
                   and "activations_sent" in by_role[f"worker{stage * tp + r}"].channels)
        stages.append({"stage": stage, "busy_s": busy_s, "idle_s": idle_s, "steps": busy.count if busy else 0,
                       "bubble_fraction": idle_s / (busy_s + idle_s) if busy_s + idle_s > 0 else 0.0,
                       "bytes_sent": sent})
    mean = sum(s["bubble_fraction"] for s in stages) / len(stages) if stages else 0.0
    return {"stages": stages, "bubble_fraction": mean}


def format_pipeline(figures: dict) -> str:
    lines = ["  stage  steps   busy s   idle s  bubble   MB sent"]
    for s in figures["stages"]:
        lines.append(f"  {s['stage']:>5}  {s['steps']:>5}  {s['busy_s']:>7.3f}  {s['idle_s']:>7.3f}  "
                     f"{s['bubble_fraction']:>6.1%}  {s['bytes_sent'] / 1e6:>8.2f}")
    lines.append(f"  bubble fraction (mean over stages): {figures['bubble_fraction']:.1%}")
    return "\n".join(lines)
