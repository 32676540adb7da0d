"""Where a LoRA step's time goes (`scripts/gpu_lora.py --parts profile`).

torch.profiler over whole engine steps (dummy weights, CUDA graphs on, one process), caught at
`ModelRunner.launch`: a prefill step of `chunk` tokens (16 prompts x 512, eager) and `steps`
full-batch decode steps of 256 rows (graph replays), in the base engine, and in the LoRA engine
with one adapter and with base requests (no adapter: what a LoRA engine costs them). The device
is synchronized at both ends of each window, so it holds whole steps.

Per window: the device time of each kernel group (GEMMs, the LoRA shrink / expand / fused
activation / plan, attention, norms, adds, the rest) and their launches per step; the union of
busy intervals; how much of the LoRA kernels' time ran beside other kernels (the side stream's
overlap); and the LoRA engine's extra busy time over the base engine's, split by group. Pure
functions over a chrome trace's events (`analyze`), so the smoke run checks them on a synthetic
trace.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections import defaultdict

import torch

GROUPS = [
    ("lora_shrink", r"_shrink_"),
    ("lora_expand_silu", r"_expand_silu"),
    ("lora_expand", r"_expand_(rows|tiles)"),
    ("lora_plan", r"_plan_tiles|searchsorted|sort|radix"),
    ("gemm", r"gemm|gemv|cutlass|nvjet|xmma|sm90_|sm80_|splitk|splitK|cublas|matmul"),
    ("attention", r"attention|attend|flash|fmha|reduce_splits|write_kv|rope_kv"),
    ("norm_rope", r"rms_norm|rotary|norm"),
    ("act", r"silu"),
    ("add_copy", r"add|copy|cat|fill|index|gather|scatter|where|Memcpy|Memset"),
    ("rest", r".*"),
]
LORA_GROUPS = ("lora_shrink", "lora_expand_silu", "lora_expand", "lora_plan")


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return group
    return "rest"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Total length of `intervals` (any) inside `cover` (a sorted union)."""
    total, j = 0.0, 0
    for a, b in sorted(intervals):
        while j < len(cover) and cover[j][1] <= a:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            total += max(0.0, min(b, cover[k][1]) - max(a, cover[k][0]))
            k += 1
    return total


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(trace: dict, cats: tuple[str, ...] = DEVICE_CATS) -> list[dict]:
    """Kernels, copies and sets of a chrome trace: name, start and duration (us), stream (`cats`:
    ("cpu_op",) on CPU, where the ops stand in for kernels)."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in cats:
            args = e.get("args", {})
            out.append({"name": e["name"], "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0)),
                        "stream": args.get("stream", 0)})
    return out


def host_launches(trace: dict) -> dict[str, int]:
    """CUDA runtime calls that launch work, by name (cudaLaunchKernel, cudaGraphLaunch, ...)."""
    counts: dict[str, int] = defaultdict(int)
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "cuda_runtime" and re.search(r"Launch|Memcpy|Memset", e.get("name", "")):
            counts[e["name"]] += 1
    return dict(counts)


def window_events(record: dict) -> tuple[list[dict], int]:
    """A worker's decode profile window (`tokenmill/worker/device_profile.py`, written under
    `gpu_lora.py --decode-profile` by the engines of the engine part): its kernels between the
    first and the last step marker as `analyze`'s events, and the number of whole steps there."""
    marker = record.get("marker", "spin_kernel")
    events = sorted(record["events"], key=lambda e: e[1])
    marks = [e[1] for e in events if marker in e[0]]
    if len(marks) >= 2:
        lo, hi, steps = marks[0], marks[-1], len(marks) - 1
    else:  # CPU (smoke): no markers; the window as one span
        lo, hi, steps = float("-inf"), float("inf"), max(int(record.get("steps", 1)), 1)
    return [{"name": n, "ts": t, "dur": d, "stream": 0} for n, t, d in events
            if marker not in n and lo <= t < hi], steps


def analyze(events: list[dict], steps: int) -> dict:
    """Per-step figures of a window of `steps` steps: device time and launches per group, the busy
    union, the LoRA kernels' time that ran beside other kernels, the top kernels."""
    steps = max(steps, 1)
    per_group: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    per_name: dict[str, list] = defaultdict(lambda: [0.0, 0, ""])
    lora, other = [], []
    for e in events:
        g = group_of(e["name"])
        per_group[g][0] += e["dur"]
        per_group[g][1] += 1
        row = per_name[e["name"]]
        row[0] += e["dur"]
        row[1] += 1
        row[2] = g
        (lora if g in LORA_GROUPS else other).append((e["ts"], e["ts"] + e["dur"]))
    busy_all = _union(lora + other)
    busy_other = _union(other)
    lora_sum = sum(b - a for a, b in lora)
    beside = _overlap(lora, busy_other)
    span = (max(b for _, b in busy_all) - min(a for a, _ in busy_all)) if busy_all else 0.0
    streams = sorted({e["stream"] for e in events})
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "steps": steps,
        "span_us": span / steps,  # first kernel's start to last kernel's end (gaps included)
        "busy_us": _length(busy_all) / steps,  # the device doing something
        "busy_without_lora_us": _length(busy_other) / steps,
        "kernel_sum_us": sum(v[0] for v in per_group.values()) / steps,
        "launches": sum(v[1] for v in per_group.values()) / steps,
        "lora_sum_us": lora_sum / steps,
        "lora_beside_us": beside / steps,  # LoRA kernel time during other kernels (the side stream)
        "lora_exposed_us": (_length(busy_all) - _length(busy_other)) / steps,  # busy time only LoRA adds
        "streams": len(streams),
        "groups": {g: {"us": v[0] / steps, "launches": v[1] / steps} for g, v in per_group.items()},
        "top": [{"name": n[:90], "group": v[2], "us": v[0] / steps, "calls": v[1] / steps} for n, v in top],
    }


def format_window(label: str, a: dict, base: dict | None, wall_ms: float) -> list[str]:
    lines = [f"### {label}: {a['steps']} step(s); wall {wall_ms:.2f} ms a step (host, profiled), device span "
             f"{a['span_us']:.0f} us, busy {a['busy_us']:.0f} us, kernels {a['kernel_sum_us']:.0f} us in "
             f"{a['launches']:.0f} launches over {a['streams']} stream(s)",
             f"LoRA kernels {a['lora_sum_us']:.0f} us a step, {a['lora_beside_us']:.0f} of it beside other kernels; "
             f"busy time only LoRA adds {a['lora_exposed_us']:.0f} us"
             + (f"; busy over the base engine's: {a['busy_us'] - base['busy_us']:+.0f} us "
                f"({100 * (a['busy_us'] / max(base['busy_us'], 1e-9) - 1):+.1f}%)" if base else ""),
             "", "| group | us a step | launches a step | vs base us |", "|---|---|---|---|"]
    for g, _ in GROUPS:
        v = a["groups"].get(g)
        if v is None:
            continue
        b = base["groups"].get(g, {"us": 0.0}) if base else None
        lines.append(f"| {g} | {v['us']:.1f} | {v['launches']:.1f} | "
                     + (f"{v['us'] - b['us']:+.1f}" if b is not None else "") + " |")
    lines += ["", "| kernel | group | us a step | calls a step |", "|---|---|---|---|"]
    lines += [f"| {t['name']} | {t['group']} | {t['us']:.1f} | {t['calls']:.1f} |" for t in a["top"][:15]]
    return lines + [""]


class StepWindows:
    """Patches `ModelRunner.launch` to run the profiler over chosen steps: `arm(want, skip, steps)`
    profiles the steps for which `want(scheduler_output)` holds, after skipping `skip` of them;
    it stops (device synchronized) at the next launch of any kind, or at `finish()`."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.prof = None
        self.want = None

    def __enter__(self):
        from tokenmill.worker.model_runner import ModelRunner
        self.original = ModelRunner.launch
        window = self

        def launch(runner, so):
            window._before(so)
            return window.original(runner, so)
        ModelRunner.launch = launch
        return self

    def __exit__(self, *exc):
        from tokenmill.worker.model_runner import ModelRunner
        ModelRunner.launch = self.original
        if self.prof is not None:
            self.prof.stop()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def arm(self, want, skip: int, steps: int) -> None:
        self.want, self.skip, self.steps, self.seen, self.caught = want, skip, steps, 0, 0
        self.t0 = self.wall = 0.0
        self.prof, self.trace = None, None

    def _before(self, so) -> None:
        if self.want is None:
            return
        hit = bool(self.want(so))
        if self.prof is not None and (self.caught >= self.steps or not hit):
            self.finish()
            return
        if not hit:
            return
        self.seen += 1
        if self.seen <= self.skip:
            return
        if self.prof is None:
            self._sync()
            activities = [torch.profiler.ProfilerActivity.CUDA if self.cuda else torch.profiler.ProfilerActivity.CPU]
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
            self.t0 = time.perf_counter()
        self.caught += 1

    def finish(self) -> None:
        """Stop the window (if open) and keep its trace."""
        if self.prof is None:
            return
        self._sync()
        self.wall = time.perf_counter() - self.t0
        self.prof.stop()
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        self.prof.export_chrome_trace(path)
        with open(path) as f:
            self.trace = json.load(f)
        os.unlink(path)
        self.prof, self.want = None, None


def decode_step(rows: int):
    return lambda so: len(so.batch_counts) == rows and int(so.batch_counts.sum()) == rows


def prefill_step(tokens: int):
    return lambda so: int(so.batch_counts.sum()) == tokens and len(so.batch_counts) * 512 >= tokens


def run_windows(llm, windows: StepWindows, prompts_for, lora_for, label: str, rows: int, chunk: int,
                steps: int, kinds: tuple[str, ...] = ("prefill", "decode")) -> dict:
    """The engine's prefill and decode windows; {kind: (trace, wall ms a step, steps caught)}."""
    from tokenmill import SamplingParams
    out = {}
    if "prefill" not in kinds:
        return _decode_window(llm, windows, prompts_for, lora_for, label, rows, steps, out)
    # prefill: chunk / 512 prompts of 512 tokens, one step (then a short decode that closes the window)
    n = max(1, chunk // 512)
    windows.arm(prefill_step(n * 512), skip=0, steps=1)
    llm.generate(prompts_for("prefill", n, 512), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                                                 detokenize=False),
                 use_tqdm=False, lora_request=lora_for(n))
    windows.finish()
    out["prefill"] = windows.trace, windows.wall * 1e3, windows.caught
    if "decode" not in kinds:
        return _checked(out, label)
    return _decode_window(llm, windows, prompts_for, lora_for, label, rows, steps, out)


def _decode_window(llm, windows, prompts_for, lora_for, label, rows, steps, out) -> dict:
    from tokenmill import SamplingParams
    # decode: `rows` prompts of 32 tokens, 2 full-batch steps skipped, `steps` profiled
    windows.arm(decode_step(rows), skip=2, steps=steps)
    llm.generate(prompts_for("decode", rows, 32), SamplingParams(temperature=0.0, max_tokens=steps + 8,
                                                                  ignore_eos=True, detokenize=False),
                 use_tqdm=False, lora_request=lora_for(rows))
    windows.finish()
    out["decode"] = windows.trace, windows.wall * 1e3 / max(windows.caught, 1), windows.caught
    return _checked(out, label)


def _checked(out: dict, label: str) -> dict:
    if any(v[0] is None or v[2] == 0 for v in out.values()):
        raise RuntimeError(f"profile {label}: a window caught no step ({[(k, v[2]) for k, v in out.items()]})")
    return out
