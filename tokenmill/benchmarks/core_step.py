"""`tokenmill bench core`: the engine core's own CPU time per step, in one process.

The scheduler and the null runner (`load_format="null"`) run here without sockets; each
step's SchedulerOutput and ModelRunnerOutput still go through msgpack, as between processes.
Times are this thread's CPU time (`time.thread_time`), so other processes on the machine do
not inflate them: this is what `tokenmill bench overhead` sees before CPU contention.

Requests (long `max_tokens`, `ignore_eos`) arrive all at once ("aligned": their blocks fill
in the same steps) or over the first steps ("staggered": every step about 1/16 of the rows
get a block or register one, as in a live engine). Per batch size, arrival and async mode:
mean and p50 µs of schedule and update, µs per running request, and the worker's side
(runner and codecs). Each figure is the lowest mean of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

import msgspec

from tokenmill.benchmarks.record import machine_info, versions
from tokenmill.config import EngineConfig, add_engine_flags, engine_args_from_flags
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.protocol import ModelRunnerOutput, SchedulerOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.null_runner import NullRunner


def add_parser(sub) -> None:
    p = sub.add_parser("core", help="engine-core CPU time per step (scheduler + null runner in one process)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                   help="gives the config only (no weights are loaded)")
    p.add_argument("--batch-sizes", default="1,64,256,1024", help="running requests, comma-separated")
    p.add_argument("--steps", type=int, default=300, help="measured steps")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--arrivals", default="aligned,staggered", help="aligned, staggered, or both")
    p.add_argument("--async-modes", default="off,on", help="async scheduling settings to run")
    p.add_argument("--repeats", type=int, default=3, help="runs per setting; the lowest means are kept")
    p.add_argument("--output-json", default=None, help="write the JSON record here")
    add_engine_flags(p)
    p.set_defaults(func=run)


def run(ns) -> int:
    from tokenmill.frontend.engine_config import resolve_engine_config

    batch_sizes = [int(b) for b in ns.batch_sizes.split(",")]
    base = engine_args_from_flags(ns, ns.model)
    base = dataclasses.replace(base, load_format="null", max_num_seqs=max(base.max_num_seqs, *batch_sizes))
    rows = []
    for arrival in ns.arrivals.split(","):
        for mode in ns.async_modes.split(","):
            config = resolve_engine_config(dataclasses.replace(base, async_scheduling=mode.strip() == "on"))
            for batch_size in batch_sizes:
                runs = [measure(config, batch_size, arrival.strip(), ns) for _ in range(ns.repeats)]
                best = {key: min(r[key] for r in runs) for key in runs[0]}
                rows.append({"arrival": arrival.strip(), "async_scheduling": mode.strip() == "on",
                             "batch_size": batch_size, **best})
                print_row(rows[-1])
    record = {"benchmark": "core", "clock": "thread CPU time",
              "workload": {"model": ns.model, "load_format": "null", "batch_sizes": batch_sizes, "steps": ns.steps,
                           "warmup_steps": ns.warmup_steps, "prompt_len": ns.prompt_len, "repeats": ns.repeats},
              "engine_args": dataclasses.asdict(base), "machine": machine_info(), "versions": versions(),
              "results": rows}
    print(json.dumps(record))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


def measure(config: EngineConfig, batch_size: int, arrival: str, ns) -> dict:
    """One run: the scheduler and the null runner stepping `batch_size` decoding requests."""
    runner = NullRunner(config)
    scheduler = Scheduler(config.scheduler, config.cache, runner.available_kv_blocks())
    in_flight = 2 if config.scheduler.async_scheduling else 1
    encode = msgspec.msgpack.Encoder().encode
    decode_step = msgspec.msgpack.Decoder(SchedulerOutput).decode
    decode_result = msgspec.msgpack.Decoder(ModelRunnerOutput).decode
    rng = random.Random(0)
    vocab, max_len = config.model.vocab_size, config.model.max_model_len
    params = SamplingParams(max_tokens=max_len - ns.prompt_len, ignore_eos=True)
    arriving = [Request(h, [rng.randrange(vocab) for _ in range(ns.prompt_len)], params,
                        config.model.eos_token_ids, max_len) for h in range(batch_size)]
    per_step = batch_size if arrival == "aligned" else max(1, batch_size // 13)
    clock = time.thread_time
    schedule_s: list[float] = []
    update_s: list[float] = []
    worker_s: list[float] = []
    queue: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    for step in range(ns.warmup_steps + ns.steps):
        if step == ns.warmup_steps:
            for samples in (schedule_s, update_s, worker_s):
                samples.clear()
        for _ in range(per_step):
            if arriving:
                scheduler.add_request(arriving.pop(0))
        while len(queue) < in_flight:
            start = clock()
            so = scheduler.schedule()
            scheduled = clock()
            if so is None:
                break
            result = decode_result(encode(runner.launch(decode_step(encode(so))).output()))
            schedule_s.append(scheduled - start)
            worker_s.append(clock() - scheduled)
            queue.append((so, result))
        start = clock()
        scheduler.update(*queue.pop(0))
        update_s.append(clock() - start)
    us = 1e6
    schedule, update = statistics.mean(schedule_s) * us, statistics.mean(update_s) * us
    return {"schedule_us": schedule, "schedule_p50_us": statistics.median(schedule_s) * us,
            "update_us": update, "update_p50_us": statistics.median(update_s) * us,
            "core_us_per_request": (schedule + update) / batch_size,
            "worker_and_codecs_us": statistics.mean(worker_s) * us}


def print_row(r: dict) -> None:
    print(f"{r['arrival']:>9} async={'on ' if r['async_scheduling'] else 'off'} batch={r['batch_size']:>5}: "
          f"schedule {r['schedule_us']:6.0f} (p50 {r['schedule_p50_us']:5.0f}) "
          f"update {r['update_us']:5.0f} (p50 {r['update_p50_us']:5.0f}) µs; "
          f"{r['core_us_per_request']:6.2f} µs/request; worker+codecs {r['worker_and_codecs_us']:5.0f} µs",
          flush=True)
