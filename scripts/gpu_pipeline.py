"""Issue 25's pipeline-parallel part on two GPUs, one command: one GPU and PP=2 layouts at the same
max_num_seqs, the bubble and its causes from the step trace, the stage probe's costs and the
partition they give, and the teacher-forced check of PP=2 against one GPU.

  bench   Llama-3.1-8B shape, dummy bfloat16 weights, 1000 prompts x 512 in x 256 out (default),
          every layout at the same --max-num-seqs, one engine each (scripts/device_check.py's bench),
          each PP layout with `--trace-steps`: output tok/s and the ratio to tp1 (goal PP=2 >= 1.85x),
          then per stage, from the trace (tokenmill/benchmarks/pipeline_trace.py): busy, bubble
          (the steady state's device idle, fill and drain apart; goal < 3%), the idle time split
          into the partition's imbalance (behind the busiest stage) and stalls, and gap by gap by
          cause (fill, drain, waiting for the previous stage, waiting for the core, launch), median decode / prompt step per stage and their imbalance,
          and how equal consecutive micro-batches are.
          Layouts: tp1, and pp2[-mbN][-dt|-nodt][-pA.B|-measured]: N micro-batches in flight
          (--pp-microbatches), sampled tokens from the last stage to the first on the devices (-dt:
          --pp-device-tokens: the host's turn-around leaves the pipeline's cycle; -nodt: the
          host's way, whatever the engine's default), layers A on stage
          0 and B on stage 1 (--pp-layer-partition A,B), -hA.B: A and B half layers (h33.31:
          16.5,15.5, stage 0 also runs layer 16's attention) or the split balanced by the stage
          probe at start ("measured"); -btN: at most N tokens per micro-batch (--max-num-batched-tokens;
          default 8192, one GPU's per step, so a round of two micro-batches holds twice one GPU's).
  probe   tokenmill/worker/stage_probe.py on GPU 0 at the bench's decode micro-batch (max_num_seqs /
          3 rows; / 2 with device tokens): a layer's (and its attention half's), the embedding's and
          the LM head's time, and the partitions stage_balance picks from them in whole and in half
          layers (printed beside the even split's times).
  check   scripts/gpu_layouts.py's teacher-forced layout check in bfloat16, PP=2 and --check-layouts
          (default: PP=2 with half layers) against one GPU (tokenmill/benchmarks/layout_check.py):
          fails (exit 1) when their logits stray further from one GPU's than two valid one-GPU
          reductions do.

  NCCL_NVLS_ENABLE=0 OUT=/tmp/gpu-out python scripts/gpu_pipeline.py --layouts tp1,pp2,pp2-mb3
  python scripts/gpu_pipeline.py --smoke           # CPU (gloo), tiny shapes: checks that it runs

Every bench run is killed (its whole process session, after each process printed its stacks) past
--run-timeout, or at --budget seconds from the start; a layout left less than --min-run is
skipped; a killed or failed layout is reported and the next one runs. Writes $OUT/gpu_pipeline.json after every part (plus benchmark records
and traces); $OUT defaults to ./gpu-out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

STARTED = time.perf_counter()  # --budget counts from here: the imports below take seconds on a fresh machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.setdefault("OUT", os.path.join(os.getcwd(), "gpu-out"))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import device_check  # noqa: E402  (bench, config_dir, SHAPES)
import gpu_layouts  # noqa: E402  (the layout check; its smoke shapes)

from tokenmill.benchmarks import pipeline_trace  # noqa: E402

_LAYOUT = re.compile(r"^pp2(?:-mb(?P<mb>\d+))?(?P<dt>-dt|-nodt)?"
                     r"(?:-(?:p(?P<a>\d+)\.(?P<b>\d+)|h(?P<ha>\d+)\.(?P<hb>\d+)|(?P<measured>measured)))?"
                     r"(?:-bt(?P<bt>\d+))?$")


def layout_flags(name: str) -> list[str]:
    """Engine flags of a layout name (see the module doc); ValueError naming an unknown one."""
    if name == "tp1":
        return []
    m = _LAYOUT.match(name)
    if m is None:
        raise ValueError(f"--layouts: unknown layout {name!r} (tp1, pp2[-mbN][-dt|-nodt][-pA.B|-hA.B|-measured][-btN])")
    flags = ["--pipeline-parallel-size", "2"]
    if m["mb"]:
        flags += ["--pp-microbatches", m["mb"]]
    if m["dt"]:
        flags += ["--pp-device-tokens" if m["dt"] == "-dt" else "--no-pp-device-tokens"]
    if m["a"]:
        flags += ["--pp-layer-partition", f"{m['a']},{m['b']}"]
    elif m["ha"]:  # half layers: 33.31 -> 16.5,15.5 (a boundary after a layer's attention)
        flags += ["--pp-layer-partition", f"{int(m['ha']) / 2:g},{int(m['hb']) / 2:g}"]
    elif m["measured"]:
        flags += ["--pp-layer-partition", "measured"]
    if m["bt"]:  # tokens per micro-batch: 4096 x 2 micro-batches = one GPU's 8192 per step
        flags += ["--max-num-batched-tokens", m["bt"]]
    return flags


def run_partition(name: str, shape: str) -> tuple[int, ...] | None:
    """The layers per stage a PP layout ran with (a measured split is not known here: the even one;
    None for half layers, which the trace's whole-layer suggestion does not model)."""
    from tokenmill.distributed.layout import even_partition
    m = _LAYOUT.match(name)
    if m and m["ha"]:
        return None
    if m and m["a"]:
        return int(m["a"]), int(m["b"])
    return even_partition(device_check.SHAPES[shape]["num_hidden_layers"], 2)


def written_record(shape: str, workload: tuple[int, int, int], name: str, since: float) -> dict | None:
    """The bench record a layout's run wrote (device_check.bench's file: `_pp_<name>` ends its
    name) since `since` (time.perf_counter), or None: a run killed while its engine shut down has
    finished its bench and its figures stand."""
    import glob
    n, lin, lout = workload
    cutoff = time.time() - (time.perf_counter() - since)
    for path in glob.glob(os.path.join(OUT, f"bench_{shape}_{n}x{lin}x{lout}_*_pp_{glob.escape(name)}.json")):
        if os.path.getmtime(path) >= cutoff:
            with open(path) as f:
                return json.load(f)
    return None


def save(results: dict) -> None:
    with open(os.path.join(OUT, "gpu_pipeline.json"), "w") as f:
        json.dump(results, f, indent=2)


def bench(results: dict, smoke: bool, layouts: list[str], max_num_seqs: int, workload: tuple[int, int, int],
          deadline: float | None, run_timeout: float, min_run: float) -> None:
    shape = "llama8b-smoke" if smoke else "llama8b"
    n, lin, lout = (8, 16, 8) if smoke else workload
    common = ["--max-num-seqs", str(max_num_seqs), "--warmup", "0"]
    if smoke:
        common += ["--kv-cache-memory-gb", "0.05"]
    figures = results.setdefault("bench", {"max_num_seqs": max_num_seqs, "workload": [n, lin, lout],
                                           "layouts": {}})["layouts"]
    for name in layouts:
        timeout = run_timeout
        if deadline is not None:
            timeout = min(timeout, deadline - time.perf_counter())
            if timeout < min_run:
                print(f"{name}: skipped (the budget leaves {max(timeout, 0):.0f} s, under --min-run {min_run:.0f})",
                      flush=True)
                figures[name] = {"skipped": "budget"}
                continue
        started = time.perf_counter()
        print(f"[{name}: starts {started - STARTED:.0f} s into the script, killed after {timeout:.0f} s]", flush=True)
        trace = os.path.join(OUT, f"trace_{name}.json")
        flags = layout_flags(name)
        pipeline = bool(flags)
        flags += ["--trace-steps", trace]  # every layout: its phases (one GPU too); PP: the bubble
        device_check.bench(results, shape, n, lin, lout, baseline=False, extra=[*flags, *common], run=f"_pp_{name}",
                           timeout_s=timeout)
        key = next(k for k in results if k.startswith(f"bench_{shape}_{n}x{lin}x{lout}") and k.endswith(f"_pp_{name}"))
        record = results.pop(key)
        tm = record.get("tokenmill") or {}
        late = None if tm else written_record(shape, (n, lin, lout), name, started)
        if late is not None:  # killed at shutdown, after the bench wrote its record (mid-session, two H100s)
            tm = late.get("tokenmill") or {}
            print(f"{name}: killed after its bench finished and wrote its record: its figures stand", flush=True)
        if not tm:  # failed or killed at its timeout (a hang): said so, and the next layouts still run
            figures[name] = {"error": (record.get("error") or "")[-600:], "seconds": time.perf_counter() - started}
            print(f"{name}: FAILED after {figures[name]['seconds']:.0f} s (timeout {timeout:.0f} s)", flush=True)
            save(results)
            continue
        fig = {k: tm.get(k) for k in ("output_tokens_per_s", "tpot_ms_p50", "device_step_ms_p50", "elapsed_s")}
        fig["engine_pipeline"] = tm.get("pipeline")  # the engine's own busy / idle totals
        for stage in (tm.get("pipeline") or {}).get("stages") or []:  # they fit in the run's wall time
            total = stage.get("busy_s", 0) + stage.get("idle_s", 0)
            print(f"  {name} stage {stage['stage']}: engine busy + idle {total:.2f} s of {tm.get('elapsed_s') or 0:.2f} s "
                  f"elapsed{' (MORE: a stale step start)' if total > 1.02 * (tm.get('elapsed_s') or 0) else ''}")
        if os.path.exists(trace):
            fig["phases"] = pipeline_trace.run_phases(pipeline_trace.load(trace))
        if pipeline and os.path.exists(trace):
            analysis = pipeline_trace.analyze(pipeline_trace.load(trace))
            partition = run_partition(name, shape)
            if analysis and partition is not None:
                analysis["partition"] = pipeline_trace.suggest_partition(analysis, partition)
            fig["trace"] = analysis
            print(pipeline_trace.format_report(name, analysis), flush=True)
        fig["seconds"] = time.perf_counter() - started
        print(f"[{name}: {fig['seconds']:.0f} s]", flush=True)
        figures[name] = fig
        save(results)
    one = (figures.get("tp1") or {}).get("output_tokens_per_s")
    print(f"\n{n} x {lin} x {lout}, max_num_seqs {max_num_seqs} for every layout")
    print(f"{'layout':<18} {'out tok/s':>10} {'x one GPU':>10} {'goal':>6} {'bubble':>8} {'stage 0':>8} "
          f"{'stage 1':>8} {'w/ fill':>8} {'tpot p50':>9}")
    for name, fig in figures.items():
        value = fig.get("output_tokens_per_s")
        ratio = value / one if value and one else None
        fig["ratio_to_one_gpu"] = ratio
        trace = fig.get("trace") or {}
        steady, whole = trace.get("bubble_steady_fraction"), trace.get("bubble_fraction")
        per_stage = [s["steady"]["bubble_fraction"] for s in trace.get("stages") or []] or [None, None]

        def pct(x):
            return "" if x is None else f"{x:.1%}"
        print(f"{name:<18} {'-' if value is None else round(value):>10} {'' if ratio is None else f'{ratio:.3f}':>10} "
              f"{'>=1.85' if name != 'tp1' else '':>6} {pct(steady):>8} {pct(per_stage[0]):>8} "
              f"{pct(per_stage[-1]):>8} {pct(whole):>8} {fig.get('tpot_ms_p50') or 0:9.2f}")
    print("(bubble: the steady state's device idle, mean over stages (stage 0, stage 1 beside it): from the last "
          "stage's first step to the first stage's last, from the step trace; goal < 3%. w/ fill: the whole run, "
          "fill and drain included)")
    base = (figures.get("tp1") or {}).get("phases") or {}
    print(f"\n{'layout':<18} {'prompt s':>9} {'steps':>6} {'x one GPU':>10} {'decode s':>9} {'steps':>6} "
          f"{'x one GPU':>10} {'device s':>9}")
    for name, fig in figures.items():
        ph = fig.get("phases") or {}
        if not ph:
            continue
        cells = []
        for part in ("prompt", "decode"):
            ms, ref = ph[part]["ms"], (base.get(part) or {}).get("ms")
            cells.append(f"{ms / 1e3:9.2f} {ph[part]['steps']:6d} {f'{ref / ms:.3f}' if ref and ms else '':>10}")
        print(f"{name:<18} {' '.join(cells)} {ph['window_ms'] / 1e3:9.2f}")
    print("(phases: the run cut where the last step with prompt tokens ends on the last stage's device; steps: the "
          "last stage's; x one GPU: tp1's time for the part over this layout's)")
    save(results)


def probe(results: dict, smoke: bool, max_num_seqs: int, context: int) -> None:
    import torch

    from tokenmill.distributed.stage_balance import balanced_halves, balanced_partition, explain, explain_halves
    from tokenmill.model.arch import model_arch
    from tokenmill.model.hf_config import load_hf_config
    from tokenmill.worker.stage_probe import measure

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    shape = "llama8b-smoke" if smoke else "llama8b"
    arch = model_arch(load_hf_config(device_check.config_dir(shape)))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    rows = max(1, max_num_seqs // 3)  # three micro-batches in flight (two stages, the async slot)
    figures = {}
    for label, r in (("decode", rows), ("decode_dt", max(1, max_num_seqs // 2))):
        costs = measure(arch, dtype, device, r, context)
        partition, halves = balanced_partition(costs, 2), balanced_halves(costs, 2)
        figures[label] = {"rows": r, "layer_ms": costs.layers[0], "attention_half_ms": costs.attention[0],
                          "embedding_ms": costs.embedding, "head_ms": costs.head, "partition": list(partition),
                          "stage_ms": costs.stage_times(partition), "halves": list(halves),
                          "halves_stage_ms": costs.halves().stage_times(halves)}
        print(f"probe {r} rows x {context} positions: {explain(costs, partition)}", flush=True)
        print(f"  in half layers: {explain_halves(costs, halves)}", flush=True)
    results["probe"] = figures
    save(results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="bench,check")
    ap.add_argument("--layouts", default="tp1,pp2,pp2-mb3")
    ap.add_argument("--max-num-seqs", type=int, default=1024, help="the same for every layout")
    ap.add_argument("--workload", default="1000x512x256", help="prompts x input x output tokens")
    ap.add_argument("--probe-context", type=int, default=640, help="probe: cached positions a row reads")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds from the start: every bench run is killed by then, and one with less than "
                         "--min-run left is skipped")
    ap.add_argument("--run-timeout", type=float, default=150.0, help="seconds: a bench run is killed past it")
    ap.add_argument("--min-run", type=float, default=30.0, help="seconds: the least a bench run is started with")
    ap.add_argument("--check-layouts", default=None,
                    help="check: layouts judged beside pp2, ';'-separated, as layout_check.Layout.parse takes them "
                         "(default pp=2,split=4.5:3.5: the check's model has 8 layers, layer 4's attention on stage 0; "
                         "smoke: 3 layers, split=1.5:1.5)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: only that the script runs")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on the lent machines
    import signal
    for sig in (signal.SIGTERM, signal.SIGINT):  # stopped from outside: no engine left holding the GPUs
        signal.signal(sig, device_check.kill_live)
    deadline = STARTED + args.budget if args.budget else None
    layouts = args.layouts.split(",")
    for name in layouts:
        layout_flags(name)  # an unknown name fails before any run
    workload = tuple(int(x) for x in args.workload.split("x"))
    import torch
    results: dict = {"smoke": args.smoke, "torch": torch.__version__, "num_gpus": torch.cuda.device_count(),
                     "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    if not args.smoke and torch.cuda.device_count() < 2:
        print("needs two GPUs (or --smoke)")
        return 2
    ok = True
    for part in args.parts.split(","):
        start = time.perf_counter()
        if part != "bench" and deadline is not None and start > deadline:
            print(f"==== {part}: skipped (past the budget)")
            continue
        print(f"==== {part}", flush=True)
        if part == "bench":
            bench(results, args.smoke, layouts, args.max_num_seqs, workload, deadline, args.run_timeout,
                  args.min_run)
        elif part == "probe":
            probe(results, args.smoke, args.max_num_seqs, args.probe_context)
        elif part == "check":
            extra = args.check_layouts if args.check_layouts is not None else \
                "pp=2,split=1.5:1.5" if args.smoke else "pp=2,split=4.5:3.5"
            ok = gpu_layouts.check(results, args.smoke, ["pp2", *filter(None, extra.split(";"))]) and ok
        else:
            raise SystemExit(f"--parts: unknown part {part!r} (bench, probe, check)")
        print(f"[{part}: {time.perf_counter() - start:.0f} s]", flush=True)
        save(results)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
