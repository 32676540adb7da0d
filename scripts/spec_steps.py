"""Per-step host time of speculative vs plain decoding at batch 1 on CUDA (single process, no
profiler): the scheduler's schedule and update, the worker's launch phases, the engine step.
`--cprofile` adds a cProfile of the timed run (the top functions by own time).
`--multiprocess` runs the engine core and the worker in their own processes (as `LLM` does by
default) and prints each process's telemetry phases instead (mean and p50, microseconds):
the core's schedule / wait / update, the worker's prepare / forward / sample / readback and
its device time per step and device idle between steps."""

from __future__ import annotations

import cProfile
import pstats
import subprocess
import sys
import time
from collections import defaultdict

sys.path.insert(0, ".")
from scripts.device_check import config_dir  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.core.engine_core import EngineCore  # noqa: E402
from tokenmill.core.scheduler import Scheduler  # noqa: E402
from tokenmill.worker.model_runner import ModelRunner  # noqa: E402
from tokenmill.worker.pending_step import PendingStep  # noqa: E402

TIMES: dict[str, list[float]] = defaultdict(list)


def timed(cls, name: str) -> None:
    inner = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            TIMES[f"{cls.__name__}.{name}"].append(time.perf_counter() - start)
            if cls is ModelRunner and name == "launch":
                for key, value in self.last_timings.items():
                    TIMES[f"  launch.{key}"].append(value)
    setattr(cls, name, wrapper)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    variant = args[0] if args else None
    if variant is None:
        for name in ("plain", "ngram"):
            subprocess.run([sys.executable, __file__, name, *sys.argv[1:]])
        return
    for cls, name in ((Scheduler, "schedule"), (Scheduler, "update"), (EngineCore, "step"),
                      (ModelRunner, "launch"), (ModelRunner, "_verify"),
                      (PendingStep, "output")):
        if hasattr(cls, name):
            timed(cls, name)
    path = config_dir("smollm2")
    prompt = {"prompt_token_ids": list(range(100, 140)) * 8}
    params = SamplingParams(temperature=0.0, max_tokens=int(args[1]) if len(args) > 1 else 256, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 4} if variant == "ngram" else None
    multiprocess = "--multiprocess" in sys.argv
    llm = LLM(path, load_format="dummy", dtype="bfloat16", single_process=not multiprocess, max_model_len=2048,
              speculative_config=spec)
    for _ in range(2):
        llm.generate([prompt], params, use_tqdm=False)
    if multiprocess:
        return telemetry_run(llm, prompt, params, variant)
    TIMES.clear()
    profile = cProfile.Profile() if "--cprofile" in sys.argv else None
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    out = llm.generate([prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if profile is not None:
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(45)
    print(f"==== {variant}: {len(out[0].outputs[0].token_ids) / elapsed:.1f} tok/s, {elapsed * 1e3:.1f} ms, "
          f"stats {llm.scheduler_stats().get('spec_num_draft_tokens')}")
    for key, values in TIMES.items():
        print(f"{key:32s} n={len(values):4d} mean {1e3 * sum(values) / len(values):7.3f} ms "
              f"total {1e3 * sum(values):8.1f} ms")
    llm.shutdown()


def telemetry_run(llm: LLM, prompt: dict, params: SamplingParams, variant: str) -> None:
    llm.reset_telemetry()
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    report = llm.telemetry()
    core = next(p for p in report.processes if p.role == "core")
    steps = core.timings["update"].count
    print(f"==== {variant} (multiprocess): {len(out[0].outputs[0].token_ids) / elapsed:.1f} tok/s, "
          f"{elapsed * 1e3:.1f} ms, {steps} steps, {elapsed * 1e3 / max(steps, 1):.3f} ms per step")
    for process in report.processes:
        phases = "  ".join(f"{name} {t.mean_us:.0f}/{t.p50_us:.0f}" for name, t in process.timings.items())
        print(f"  {process.role:9s} {phases}")
    llm.shutdown()


if __name__ == "__main__":
    main()
