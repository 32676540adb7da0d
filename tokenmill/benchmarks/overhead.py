"""`tokenmill bench overhead`: the engine's own cost per step, with the null model.

The full multi-process engine (front-end, engine core, worker) runs `load_format="null"`:
the worker samples random tokens without a model, so every figure is engine overhead.
For each batch size it keeps that many requests decoding (long `max_tokens`, `ignore_eos`;
a request that finishes is replaced), warms up, resets every process's telemetry, runs a
window of steps and reads the telemetry back. Async scheduling off and on run side by side.
Prints per batch size: bytes per step in each direction, core time per step, steps/s and
front-end tokens/s; writes a JSON record, and a PNG plot when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import time

import msgspec

from tokenmill.benchmarks.record import machine_info, versions
from tokenmill.config import add_engine_flags, engine_args_from_flags
from tokenmill.metrics.message_stats import merge_channels
from tokenmill.protocol import ChannelStats, ProcessTelemetry, TelemetryReport

_CORE_PHASES = ("schedule", "submit", "update")


def add_parser(sub) -> None:
    p = sub.add_parser("overhead", help="engine overhead per step with the null model, async scheduling off and on",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                   help="gives the tokenizer and config only (no weights are loaded)")
    p.add_argument("--batch-sizes", default="1,4,16,64,256,1024", help="running requests, comma-separated")
    p.add_argument("--steps", type=int, default=200, help="measured steps per batch size")
    p.add_argument("--warmup-steps", type=int, default=20, help="steps before measuring (prefill included)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--async-modes", default="off,on", help="async scheduling settings to run: off, on, or both")
    p.add_argument("--output-json", default=None, help="write the JSON record here")
    p.add_argument("--plot", default=None, metavar="PNG", help="plot steps/s and bytes per step (needs matplotlib)")
    add_engine_flags(p)
    p.set_defaults(func=run)


def run(ns) -> int:
    batch_sizes = [int(b) for b in ns.batch_sizes.split(",")]
    modes = [{"off": False, "on": True}[m.strip()] for m in ns.async_modes.split(",")]
    if min(batch_sizes) < 1 or ns.steps < 1 or ns.prompt_len < 1:
        raise ValueError("batch sizes, --steps and --prompt-len must be >= 1")
    base = engine_args_from_flags(ns, ns.model)
    base = dataclasses.replace(base, load_format="null", max_num_seqs=max(base.max_num_seqs, *batch_sizes))
    rows = []
    for async_scheduling in modes:
        rows.extend(_run_mode(dataclasses.replace(base, async_scheduling=async_scheduling), batch_sizes, ns))
    record = {
        "benchmark": "overhead",
        "workload": {"model": ns.model, "load_format": "null", "batch_sizes": batch_sizes, "steps": ns.steps,
                     "warmup_steps": ns.warmup_steps, "prompt_len": ns.prompt_len, "ignore_eos": True},
        "engine_args": dataclasses.asdict(base),
        "machine": machine_info(), "versions": versions(),
        "results": rows,
    }
    print_table(rows)
    print(json.dumps(record))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(record, f, indent=2)
    if ns.plot:
        plot(rows, ns.plot)
    return 0


def _run_mode(engine_args, batch_sizes: list[int], ns) -> list[dict]:
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_args))
    try:
        driver = _Driver(llm, ns.prompt_len)
        rows = []
        for batch_size in batch_sizes:
            window_s, fe_steps, tokens, report = driver.measure(batch_size, ns.warmup_steps, ns.steps)
            rows.append({"async_scheduling": engine_args.async_scheduling, "batch_size": batch_size,
                         **figures(report, window_s, fe_steps, tokens, batch_size)})
            print(f"async={'on' if engine_args.async_scheduling else 'off'} batch={batch_size}: "
                  f"{rows[-1]['core_steps_per_s']:.0f} steps/s", flush=True)
        return rows
    finally:
        llm.shutdown()


class _Driver:
    """Keeps `batch_size` requests decoding through the LLM's own front-end, one step at a time."""

    def __init__(self, llm, prompt_len: int) -> None:
        from tokenmill.sampling_params import RequestOutputKind, SamplingParams

        self.llm = llm
        vocab = min(llm.config.model.vocab_size, len(llm.get_tokenizer()))
        self._rng = random.Random(0)
        self._prompt = lambda: [self._rng.randrange(vocab) for _ in range(prompt_len)]
        max_tokens = llm.config.model.max_model_len - prompt_len
        if max_tokens < 1:
            raise ValueError(f"--prompt-len {prompt_len} leaves no room under max_model_len")
        self._params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0,
                                      output_kind=RequestOutputKind.FINAL_ONLY)
        self._ids = itertools.count()
        self._live: set[str] = set()

    def _add(self) -> None:
        frontend = self.llm.frontend
        request_id = f"overhead-{next(self._ids)}"
        frontend.submit(request_id, frontend.prepare({"prompt_token_ids": self._prompt()}, self._params))
        self._live.add(request_id)

    def _step(self) -> int:
        """Receive and process one step's outputs; replace finished requests; tokens received."""
        outputs = self.llm.client.get_outputs()
        processed = self.llm.frontend.process(outputs)
        for failure in processed.failures.values():
            raise failure
        for out in processed.request_outputs:
            if out.finished:
                self._live.discard(out.request_id)
                self._add()
        return outputs.num_new_tokens()

    def measure(self, batch_size: int, warmup: int, steps: int) -> tuple[float, int, int, TelemetryReport]:
        for _ in range(batch_size):
            self._add()
        for _ in range(warmup):
            self._step()
        self._catch_up(warmup + steps)
        self.llm.reset_telemetry()
        self._catch_up(warmup + steps)
        start, tokens = time.perf_counter(), 0
        for _ in range(steps):
            tokens += self._step()
        window = time.perf_counter() - start
        report = self.llm.telemetry()
        self._stop_all()
        return window, steps, tokens, report

    def _catch_up(self, limit: int) -> None:
        """Take the outputs of steps the core ran ahead (at most `limit`: a front-end slower
        than the core never catches up), so the window measures a rate, not a backlog."""
        for _ in range(limit):
            if not self.llm.client.outputs_ready():
                return
            self._step()

    def _stop_all(self) -> None:
        for request_id in self._live:
            self.llm.frontend.abort(request_id)
        self._live.clear()
        while self.llm.kv_cache_stats()["num_requests"]:
            time.sleep(0.01)
        # Outputs the core ran ahead with arrived before that answer: drop them, or the next
        # batch size's window would count these stale steps as front-end steps.
        while self.llm.client.outputs_ready():
            self.llm.client.get_outputs()


def _process(report: TelemetryReport, role: str) -> ProcessTelemetry:
    for proc in report.processes:
        if proc.role == role:
            return proc
    return ProcessTelemetry(role=role, pid=0, elapsed_s=0.0)


def _channel(report: TelemetryReport, name: str, *roles: str) -> ChannelStats:
    return merge_channels(*(_process(report, r).channels.get(name, ChannelStats()) for r in roles))


def _mean_us(proc: ProcessTelemetry, name: str) -> float:
    timing = proc.timings.get(name)
    return timing.mean_us if timing is not None else 0.0


def figures(report: TelemetryReport, window_s: float, fe_steps: int, tokens: int, batch_size: int) -> dict:
    core, worker = _process(report, "core"), _process(report, "worker0")
    steps = _channel(report, "steps", "core", "worker0")
    results = _channel(report, "results", "core", "worker0")
    outputs = _channel(report, "outputs", "core", "frontend")
    per = lambda c: c.bytes_total / c.count if c.count else 0.0  # noqa: E731
    idle = worker.timings.get("device_idle")
    return {
        "core_steps": steps.count,
        "core_steps_per_s": steps.count / core.elapsed_s if core.elapsed_s else 0.0,
        "frontend_steps_per_s": fe_steps / window_s,
        "frontend_tokens_per_s": tokens / window_s,
        "sched_to_worker_bytes_p50": steps.bytes_p50, "sched_to_worker_bytes_mean": per(steps),
        "worker_to_core_bytes_p50": results.bytes_p50, "worker_to_core_bytes_mean": per(results),
        "worker_to_core_bytes_per_request": results.bytes_p50 / batch_size,
        "core_to_frontend_bytes_p50": outputs.bytes_p50, "core_to_frontend_bytes_mean": per(outputs),
        "encode_decode_us_per_step": {name: {"encode": c.encode_us / c.count if c.count else 0.0,
                                             "decode": c.decode_us / c.count if c.count else 0.0}
                                      for name, c in (("steps", steps), ("results", results), ("outputs", outputs))},
        "core_us_per_step": sum(_mean_us(core, p) for p in _CORE_PHASES),
        "core_phase_us": {name: msgspec.structs.asdict(t) for name, t in core.timings.items()},
        "worker_phase_us": {name: msgspec.structs.asdict(t) for name, t in worker.timings.items()},
        "device_idle_us_p50": idle.p50_us if idle else 0.0,
    }


def print_table(rows: list[dict]) -> None:
    head = (f"{'batch':>6} {'async':>5} {'core st/s':>9} {'fe st/s':>8} {'fe tok/s':>9} "
            f"{'sch>wkr B':>10} {'wkr>core B':>11} {'B/req':>5} {'core>fe B':>10} "
            f"{'core us/st':>10} {'sched':>6} {'submit':>6} {'update':>6} {'wait':>6}")
    print("bytes: p50 (mean) per step; core us/step = schedule + submit + update (means, µs)")
    print(head)
    for r in sorted(rows, key=lambda r: (r["batch_size"], r["async_scheduling"])):
        phase = lambda name: r["core_phase_us"].get(name, {}).get("mean_us", 0.0)  # noqa: E731
        print(f"{r['batch_size']:>6} {'on' if r['async_scheduling'] else 'off':>5} "
              f"{r['core_steps_per_s']:>9.0f} {r['frontend_steps_per_s']:>8.0f} {r['frontend_tokens_per_s']:>9.0f} "
              f"{_bytes(r, 'sched_to_worker'):>10} {_bytes(r, 'worker_to_core'):>11} "
              f"{r['worker_to_core_bytes_per_request']:>5.1f} {_bytes(r, 'core_to_frontend'):>10} "
              f"{r['core_us_per_step']:>10.0f} {phase('schedule'):>6.0f} {phase('submit'):>6.0f} "
              f"{phase('update'):>6.0f} {phase('wait'):>6.0f}")


def _bytes(row: dict, prefix: str) -> str:
    return f"{row[prefix + '_bytes_p50']}({row[prefix + '_bytes_mean']:.0f})"


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'tokenmill[bench]')")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    bytes_plotted = False  # bytes per step do not depend on async scheduling: plot them once
    for mode in (False, True):
        sel = sorted((r for r in rows if r["async_scheduling"] == mode), key=lambda r: r["batch_size"])
        if not sel:
            continue
        label = f"async {'on' if mode else 'off'}"
        sizes = [r["batch_size"] for r in sel]
        left.plot(sizes, [r["core_steps_per_s"] for r in sel], "o-", label=f"core steps/s, {label}")
        left.plot(sizes, [r["frontend_steps_per_s"] for r in sel], "x--", label=f"front-end steps/s, {label}")
        if not bytes_plotted:
            bytes_plotted = True
            right.plot(sizes, [r["sched_to_worker_bytes_mean"] for r in sel], "o-", label="scheduler→worker")
            right.plot(sizes, [r["worker_to_core_bytes_mean"] for r in sel], "o-", label="worker→core")
            right.plot(sizes, [r["core_to_frontend_bytes_mean"] for r in sel], "o-", label="core→front-end")
    for ax, title in ((left, "steps per second"), (right, "bytes per step (mean)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("running requests")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")
