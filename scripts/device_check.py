"""CUDA checks and timings, run on a lent GPU in one call. Prints a table per part and writes
$OUT/device_check.json (and each benchmark's own record next to it).

Real checkpoints cannot travel to the device machine, so models are random weights of a real
model's config, saved as a HF directory (parity) or described by a config only (`dummy`
weights, benchmarks). Parts:
  pytest      tests/layers and the model-vs-HF tests, natively on the GPU
  fused       scripts/fused_ops_check.py; triton: scripts/triton_attention_check.py --quick
  tiny        every supported family (tiny configs) vs HF float32 greedy, each dtype
  parity      SmolLM2-135M shape, 16 prompts x 64 tokens: float32 vs HF float32 (Triton + graphs,
              and the torch reference eagerly), bfloat16 Triton + graphs vs the torch reference
  bench:S     `tokenmill bench throughput` on shape S (smollm2, llama1b, llama8b) vs HF, warmed
  long:S      1000 prompts x 512 in x 256 out on shape S (tokenmill only)
  batch1:S    one prompt, 512 in x 256 out: time per output token
  rowfaults   row-level faults on CUDA (NaN logits / a sampling error fail only their request, also
              through decode-graph replays: tests/e2e/test_row_faults.py, tests/worker/test_row_faults.py),
              and the per-step cost of the non-finite screen next to a Llama-8B LM head
  spec1:S     batch 1, 512 in x 256 out: plain, then the target as its own draft (k=4)
  spec256:S   `tokenmill bench spec --dataset random`: 256 x 256 x 128, plain and adaptive n-gram
              (k=4) both alive, six interleaved timed passes each
  specsat:S   the same at 1024 x 256 x 128 (four waves of 256 rows: longer passes), four rounds
              (specsat:S:R, and specctl:S:R below: R rounds)
  specdraft:S the same with a draft model (shape S-draft, dummy weights, k=4), three rounds
  specctl:S   specsat's control: n-gram that can never draft (max_step_tokens 1): the harness's own
              spread between two engines that run the same steps
  specreal:P  `tokenmill bench spec` on the GGUF file P (the real SmolLM2), batch 1: n-gram k=4 in
              bfloat16 and float32, k=8 in bfloat16, then the model as its own draft (k=4, bfloat16);
              specreal:P:ngram runs the first alone
  specrealsat:P  the real SmolLM2, 512 copy-heavy prompts at once (256 rows), n-gram k=4 vs plain,
              eight interleaved rounds (no prefix cache)
  specsteps[:cprofile|:mp]  scripts/spec_steps.py: host time per step, plain vs n-gram, batch 1
              (mp: the engine core and worker in their own processes, each one's telemetry phases)
  specgraphs  scripts/spec_graph_check.py: speculative outputs = plain on CUDA, every graph on
  spec_sampler  the speculative-decoding sampler tests on CUDA (bfloat16 logits in the distribution
              and greedy tests), then scripts/spec_sampler_check.py: verification and rejection
              sampling timed at R=256, K=4, V=49152, no host sync, allocated memory
  parallel[:D] (2 GPUs) TP=2 and PP=2 (CUDA graphs: the all-reduce inside them, a stage's graphs over
              its layers), both eager, and TP=2 sync vs one GPU: Llama-3.2-1B shape, random weights,
              dtype D (float32 or bfloat16; both when omitted), 16 prompts x 64 tokens
  pbench:S:L  (L = tp1 | tp2 | pp2 | pp2-512) 1000 prompts x 512 in x 256 out on shape S with layout L;
              the record holds output tok/s and, with PP, each stage's busy time and the bubble fraction

    python scripts/device_check.py --parts tiny,parity,bench:smollm2,bench:llama1b
    NCCL_NVLS_ENABLE=0 python scripts/device_check.py --parts parallel:float32
    NCCL_NVLS_ENABLE=0 python scripts/device_check.py --parts pbench:llama8b:tp1,pbench:llama8b:tp2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.helpers.hf_reference import compare_greedy, hf_greedy  # noqa: E402
from tests.helpers.tiny_models import make_tiny_tokenizer  # noqa: E402

_COMMON = dict(rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    tie_word_embeddings=True, rope_theta=100000.0, **_COMMON),
    "llama1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                    tie_word_embeddings=True, rope_theta=500000.0, **_COMMON),
    # A draft for the Llama-3 vocabulary: 4 layers of width 512 (about 70M parameters, most in the embedding).
    "llama1b-draft": dict(vocab_size=128256, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=131072,
                          tie_word_embeddings=True, rope_theta=500000.0, **_COMMON),
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                    tie_word_embeddings=False, rope_theta=500000.0, **_COMMON),
}
LENGTHS = [5, 8, 13, 21, 34, 55, 89, 120, 160, 210, 270, 330, 400, 470, 540, 600]
OUT = os.environ.get("OUT", tempfile.mkdtemp())


def config_dir(shape: str) -> str:
    """A HF directory with only config.json and a (tiny) tokenizer: for `load_format=dummy`."""
    from transformers import LlamaConfig
    path = tempfile.mkdtemp(prefix=f"{shape}-config-")
    config = LlamaConfig(**SHAPES[shape])
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def weights_dir(shape: str) -> str:
    """Random weights of `shape` saved as safetensors, larger than HF's init so logits are peaked."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(**SHAPES[shape])
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.06)
    path = tempfile.mkdtemp(prefix=f"{shape}-weights-")
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def greedy_outputs(path: str, prompts, dtype: str, with_gaps: bool = False, **engine):
    """Greedy token ids per prompt; with `with_gaps`, also each position's top-2 logprob gap."""
    from tokenmill import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, detokenize=False,
                            logprobs=2 if with_gaps else None)
    reference = engine.get("attention_backend") == "torch"
    if reference:  # the plain torch path: no fused Triton kernels either (read by the worker process)
        os.environ["TOKENMILL_NO_FUSED_OPS"] = "1"
    try:
        with LLM(path, dtype=dtype, gpu_memory_utilization=0.3, max_model_len=2048, **engine) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            stats = llm.kv_cache_stats()
            assert stats["num_free_blocks"] == stats["num_blocks"], f"KV blocks leaked: {stats}"
    finally:
        os.environ.pop("TOKENMILL_NO_FUSED_OPS", None)
    ids = [o.outputs[0].token_ids for o in outs]
    if not with_gaps:
        return ids
    gaps = [[_top2_gap(lp) for lp in o.outputs[0].logprobs] for o in outs]
    return ids, gaps


def _top2_gap(position_logprobs) -> float:
    top = sorted((lp.logprob for lp in position_logprobs.values()), reverse=True)
    return top[0] - top[1]


def count_matches(outputs, references, label: str) -> dict:
    exact = near_tie = mismatch = 0
    notes = []
    for i, (ours, ref) in enumerate(zip(outputs, references)):
        try:
            note = compare_greedy(ours, ref, f"{label} prompt {i}")
        except AssertionError as exc:
            mismatch += 1
            notes.append(str(exc).splitlines()[0])
            continue
        near_tie += note is not None
        exact += note is None
        if note:
            notes.append(note)
    print(f"{label}: exact {exact}/{len(outputs)}, near-tie {near_tie}, mismatch {mismatch}")
    for note in notes:
        print("   ", note)
    return {"exact": exact, "near_tie": near_tie, "mismatch": mismatch, "notes": notes}


def parity(results: dict) -> None:
    from transformers import AutoModelForCausalLM
    path = weights_dir("smollm2")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in LENGTHS]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    refs = [hf_greedy(hf, p, 64) for p in prompts]
    del hf
    runs = {
        "fp32_triton_graphs": greedy_outputs(path, prompts, "float32"),
        "fp32_triton_graphs_chunk256": greedy_outputs(path, prompts, "float32", max_num_batched_tokens=256),
        "fp32_torch_eager": greedy_outputs(path, prompts, "float32", attention_backend="torch", enforce_eager=True),
    }
    for name, outs in runs.items():
        results[f"parity_vs_hf_{name}"] = count_matches(outs, refs, f"{name} vs HF fp32")
    # bf16: the fast path against the reference backend on the same weights and dtype. Ties are
    # judged by HF fp32's gaps, a proxy: bf16 rounding differs between any two implementations.
    for dtype in ("float32", "bfloat16"):
        fast = greedy_outputs(path, prompts, dtype)
        ref, gaps = greedy_outputs(path, prompts, dtype, with_gaps=True, attention_backend="torch",
                                   enforce_eager=True)
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(fast, ref)]
        gap_at = [None if i is None else round(g[i], 5) for i, g in zip(first, gaps)]
        same = sum(i is None for i in first)
        results[f"{dtype}_fast_vs_torch_eager"] = {"identical": same, "first_divergence": first,
                                                   "reference_top2_gap_there": gap_at}
        print(f"{dtype} Triton+graphs+fused vs torch eager: identical {same}/16; first divergence {first}; "
              f"reference top-2 gap there {gap_at}")


def tiny_families(results: dict) -> None:
    from transformers import AutoModelForCausalLM

    from tests.helpers.tiny_models import ARCHS, make_tiny_model_dir
    from tokenmill import LLM, SamplingParams
    rng = random.Random(0)
    for arch in ARCHS:
        for tied in (False, True):
            path = make_tiny_model_dir(arch, tempfile.mkdtemp(), tie_word_embeddings=tied)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
            prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in (1, 7, 33, 100)]
            refs = [hf_greedy(hf, p, 24) for p in prompts]
            for dtype in ("float32", "bfloat16", "float16"):
                with LLM(path, dtype=dtype, gpu_memory_utilization=0.2, max_num_batched_tokens=64) as llm:
                    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
                key = f"tiny_{arch}_{'tied' if tied else 'untied'}_{dtype}"
                results[key] = count_matches([o.outputs[0].token_ids for o in outs], refs, key)


def bench(results: dict, shape: str, num_prompts: int, input_len: int, output_len: int, baseline: bool,
          extra: list[str] = (), run: str = "", timeout_s: float | None = None) -> None:
    """`run`: a suffix that tells repeated runs of the same bench apart (records and keys).
    `timeout_s`: past it the run and every process it started (its session) are killed, and its
    record says so (a hung engine must not hold the GPUs for the runs after it)."""
    path = config_dir(shape)
    extra = [e.replace('"SAME"', json.dumps(path)) for e in extra]
    if "--speculative-config" in extra:  # the JSON holds a path: name the record by the method
        tag = "spec_" + json.loads(extra[extra.index("--speculative-config") + 1])["method"]
    else:
        tag = "".join(ch for ch in "_".join(extra) if ch.isalnum() or ch == "_")
    tag += run
    record = os.path.join(OUT, f"bench_{shape}_{num_prompts}x{input_len}x{output_len}{'_' + tag if tag else ''}.json")
    argv = [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "bench", "throughput",
            "--model", path, "--load-format", "dummy", "--dtype", "bfloat16", "--num-prompts", str(num_prompts),
            "--input-len", str(input_len), "--output-len", str(output_len), "--ignore-eos",
            "--max-model-len", str(input_len + output_len + 16), "--output-json", record, *extra]
    if baseline:
        argv += ["--baseline", "hf"]
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    proc = run_killable(argv, env, timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if not ln.startswith("{")]
    print("\n".join(lines[-30:]))
    if proc.returncode != 0:
        print(proc.stderr[-(12000 if proc.returncode == 124 else 3000):])
    key = f"bench_{shape}_{num_prompts}x{input_len}x{output_len}{tag}"
    if proc.returncode == 0 and os.path.exists(record):
        with open(record) as f:
            rec = json.load(f)
        results[key] = {k: rec.get(k) for k in ("tokenmill", "baseline", "ratio_output_tokens_per_s", "roofline",
                                                "first_over_timed_run")}
    else:
        results[key] = {"error": proc.stderr[-2000:]}
    print(f"[{key} took {time.perf_counter() - start:.0f} s]")


def run_killable(argv: list[str], env: dict, timeout_s: float | None) -> subprocess.CompletedProcess:
    """`subprocess.run` in a session of its own: on timeout every process of the session (the
    engine's core and workers too) first prints its threads' stacks (SIGABRT with Python's
    faulthandler on: where a hang sits), then is killed; returncode 124 and a note in stderr."""
    import signal
    env = {**env, "PYTHONFAULTHANDLER": "1"}
    import resource

    def no_core_files() -> None:  # an aborted engine must not write a core file of its mappings
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=no_core_files)
    LIVE.add(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=3)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the session is left (workers)
        except ProcessLookupError:
            pass
        proc.wait()
        time.sleep(2)  # the killed workers' GPU memory is released
        return subprocess.CompletedProcess(argv, 124, out or "", (err or "") + f"\nTIMEOUT: killed after {timeout_s:.0f} s")
    finally:
        LIVE.discard(proc.pid)


LIVE: set[int] = set()  # sessions of runs under way (`kill_live` ends them when the script is stopped)


def kill_live(*_args) -> None:
    """Kill every run's session still under way, then exit (a SIGTERM / SIGINT handler)."""
    import signal
    for pid in list(LIVE):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit(124)


def spec_ab(results: dict, shape: str, num_prompts: int, rounds: int, spec: dict, tag: str) -> None:
    """`bench spec --dataset random`: plain vs `spec` at saturation (num_prompts x 256 x 128, all
    submitted at once, max_num_seqs 256), both engines alive, `rounds` interleaved passes each, on
    the same prompts every round (no prefix cache), so that plain's own run-to-run differences
    are counted beside plain vs speculative's."""
    path = config_dir(shape)
    if spec.get("model") == "DRAFT":
        spec = {**spec, "model": config_dir(f"{shape}-draft")}
    key = f"specab_{shape}_{num_prompts}x256x128_{tag}_r{rounds}"
    record = os.path.join(OUT, f"{key}.json")
    run_script(results, key, [
        "-m", "tokenmill.cli", "--log-level", "WARNING", "bench", "spec", "--model", path, "--load-format", "dummy",
        "--dtype", "bfloat16", "--dataset", "random", "--num-prompts", str(num_prompts), "--concurrency",
        str(num_prompts), "--input-len", "256", "--output-len", "128", "--ignore-eos", "--max-model-len", "400",
        "--rounds", str(rounds), "--repeat-prompts", "--no-enable-prefix-caching", "--output-json", record,
        "--speculative-config", json.dumps(spec)])
    if os.path.exists(record):
        with open(record) as f:
            rec = json.load(f)
        results[key].update({k: rec.get(k) for k in ("speedup", "speedup_per_round", "outputs_identical",
                                                     "requests_differing_per_round",
                                                     "plain_requests_differing_from_round_1")})
        results[key].update({name: {k: rec[name].get(k) for k in ("output_tokens_per_s", "draft_tokens",
                                                                   "accepted_tokens", "passes")}
                             for name in ("plain", "speculative")})


def row_fault_costs(results: dict) -> None:
    """µs per step of the non-finite screen (+ the read-back marking) on bf16 logits, beside the
    LM-head matmul that produced them (hidden 4096, vocab 128256: Llama-3-8B)."""
    from tokenmill.layers.sampling import SamplerOutput
    from tokenmill.worker.row_faults import mark_failed, screen_logits

    def timed(fn, reps: int = 50) -> float:
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / reps

    head = torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 64, 256):
        hidden = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        logits = hidden @ head.T
        out = SamplerOutput(logits.argmax(-1), None)
        screen_us = timed(lambda: mark_failed(out, screen_logits(logits), []))
        head_us = timed(lambda: hidden @ head.T)
        results[f"row_screen_{rows}_rows"] = {"screen_us": round(screen_us, 1), "lm_head_us": round(head_us, 1)}
        print(f"{rows:>4} rows: screen + mark {screen_us:8.1f} us   LM head {head_us:8.1f} us")
# pp2-512: the two micro-batches share max_num_seqs; 512 gives each stage the batch one GPU gets at 256.
_LAYOUTS = {"tp1": [], "tp2": ["--tensor-parallel-size", "2"], "pp2": ["--pipeline-parallel-size", "2"],
            "pp2-512": ["--pipeline-parallel-size", "2", "--max-num-seqs", "512"]}


def parallel(results: dict, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> None:
    """Split models vs one GPU, token for token: identical prompts, and where they first differ,
    the one-GPU run's top-2 logprob gap there (a near tie is rounding, not a bug)."""
    path = weights_dir("llama1b")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128256) for _ in range(n)] for n in LENGTHS]
    variants = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2),
                "tp2_eager": dict(tensor_parallel_size=2, enforce_eager=True),
                "pp2_eager": dict(pipeline_parallel_size=2, enforce_eager=True),
                "tp2_sync": dict(tensor_parallel_size=2, async_scheduling=False)}
    for dtype in dtypes:
        ref, gaps = greedy_outputs(path, prompts, dtype, with_gaps=True)
        for name, engine in variants.items():
            start = time.perf_counter()
            outs = greedy_outputs(path, prompts, dtype, **engine)
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(outs, ref)]
            gap_at = [None if i is None else round(g[i], 5) for i, g in zip(first, gaps)]
            same = sum(i is None for i in first)
            results[f"parallel_{name}_{dtype}"] = {"identical": same, "first_divergence": first,
                                                    "one_gpu_top2_gap_there": gap_at,
                                                    "seconds": time.perf_counter() - start}
            print(f"{name} {dtype} vs one GPU: identical {same}/{len(prompts)}; first divergence {first}; "
                  f"one-GPU top-2 gap there {gap_at}")


def run_script(results: dict, key: str, argv: list[str]) -> None:
    """A check that is its own program (pytest, a kernel check script): its exit status and tail."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True)
    # Progress bars go to stderr: shown only when the program failed.
    tail = proc.stdout[-2500:] + (proc.stderr[-2500:] if proc.returncode else "")
    print(tail)
    results[key] = {"returncode": proc.returncode, "tail": tail[-800:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="tiny,parity,bench:smollm2")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on the lent machines (workers inherit it)
    results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "num_gpus": torch.cuda.device_count()}
    for part in args.parts.split(","):
        name, _, shape = part.partition(":")
        start = time.perf_counter()
        print(f"==== {part}")
        if name == "pytest":
            # The Triton interpreter tests are CPU-only (their modules turn the interpreter on for the
            # whole process); the kernels themselves are checked natively by the `triton`/`fused` parts.
            run_script(results, "pytest", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/layers",
                                           "tests/model/test_llama_vs_hf.py",
                                           "--ignore=tests/layers/test_triton_attention.py",
                                           "--ignore=tests/layers/test_triton_ops.py"])
        elif name == "fused":
            run_script(results, "fused_ops_check", ["scripts/fused_ops_check.py"])
        elif name == "triton":
            run_script(results, "triton_attention_check", ["scripts/triton_attention_check.py", "--quick"])
        elif name == "spec_sampler":
            run_script(results, "spec_sampler_pytest", [
                "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda", "tests/layers/test_spec_verify.py",
                "tests/layers/test_spec_sampler.py", "tests/layers/test_spec_distribution.py",
                "tests/layers/test_sampler.py", "tests/layers/test_sampler_stages.py",
                "tests/layers/test_sampling_state.py"])
            run_script(results, "spec_sampler_timing", ["scripts/spec_sampler_check.py", "--output-json",
                                                        os.path.join(OUT, "spec_sampler.json")])
        elif name == "tiny":
            tiny_families(results)
        elif name == "parity":
            parity(results)
        elif name == "bench":
            bench(results, shape, 256, 256, 128, baseline=True)
        elif name == "long":
            bench(results, shape, 1000, 512, 256, baseline=False)
        elif name == "batch1":
            bench(results, shape, 1, 512, 256, baseline=False)
        elif name == "rowfaults":
            run_script(results, "row_faults", ["-m", "pytest", "-q", "-p", "no:cacheprovider",
                                               "tests/e2e/test_row_faults.py", "tests/worker/test_row_faults.py"])
            row_fault_costs(results)
        elif name == "spec1":  # batch 1: plain, then the target as its own draft (the mechanics' ceiling)
            bench(results, shape, 1, 512, 256, baseline=False)
            bench(results, shape, 1, 512, 256, baseline=False, extra=["--speculative-config", json.dumps(
                {"method": "draft_model", "model": "SAME", "num_speculative_tokens": 4, "max_step_tokens": 0})])
        elif name == "spec256":  # saturation: adaptive n-gram must not cost throughput
            spec_ab(results, shape, 256, 6, {"method": "ngram", "num_speculative_tokens": 4}, "ngram")
        elif name == "specsat":  # the same, longer passes (specsat:S:R: R rounds, default 4)
            shape, _, rounds = shape.partition(":")
            spec_ab(results, shape, 1024, int(rounds or 4), {"method": "ngram", "num_speculative_tokens": 4}, "ngram")
        elif name == "specctl":  # the control: n-gram that can never draft (max_step_tokens 1), always dormant
            shape, _, rounds = shape.partition(":")
            spec_ab(results, shape, 1024, int(rounds or 4),
                    {"method": "ngram", "num_speculative_tokens": 4, "max_step_tokens": 1}, "never")
        elif name == "specdraft":  # the same with a draft model (its state dropped at saturation)
            spec_ab(results, shape, 1024, 3, {"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 4},
                    "draft")
        elif name == "specreal":  # specreal:GGUF_PATH[:ngram]: the real SmolLM2 at batch 1, n-gram vs plain
            shape, _, only = shape.partition(":")  # only: bf16 n-gram k=4 alone
            ngram = {"method": "ngram", "num_speculative_tokens": 4}
            self_draft = {"method": "draft_model", "model": shape, "num_speculative_tokens": 4}
            ngram8 = {**ngram, "num_speculative_tokens": 8}
            runs = (("ngram", "bfloat16", ngram), ("ngram", "float32", ngram),
                    ("ngram8", "bfloat16", ngram8), ("self_draft", "bfloat16", self_draft))
            for method, dtype, spec in runs[:1] if only else runs:
                record = os.path.join(OUT, f"spec_real_{method}_{dtype}.json")
                run_script(results, f"spec_real_{method}_{dtype}", [
                    "-m", "tokenmill.cli", "--log-level", "WARNING", "bench", "spec", "--model", shape,
                    "--dtype", dtype, "--num-prompts", "8", "--output-len", "256", "--output-json", record,
                    "--speculative-config", json.dumps(spec)])
        elif name == "specrealsat":  # specrealsat:GGUF_PATH: the real SmolLM2, 512 copy prompts at once, n-gram
            record = os.path.join(OUT, "spec_real_sat_ngram_bfloat16.json")
            run_script(results, "spec_real_sat_ngram_bfloat16", [
                "-m", "tokenmill.cli", "--log-level", "WARNING", "bench", "spec", "--model", shape,
                "--dtype", "bfloat16", "--num-prompts", "512", "--concurrency", "512", "--output-len", "256",
                "--rounds", "8", "--no-enable-prefix-caching", "--output-json", record,
                "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4})])
        elif name == "specsteps":  # host time per step, plain vs n-gram, batch 1 (scripts/spec_steps.py)
            flag = {"cprofile": ["--cprofile"], "mp": ["--multiprocess"]}.get(shape, [])
            run_script(results, f"spec_steps{'_' + shape if shape else ''}", ["scripts/spec_steps.py", *flag])
        elif name == "specgraphs":  # speculative outputs = plain on CUDA with every graph on
            run_script(results, "spec_graphs", ["scripts/spec_graph_check.py", "--output-json",
                                                os.path.join(OUT, "spec_graph_check.json")])
        elif name == "parallel":  # parallel:float32 or parallel:bfloat16 runs one dtype
            parallel(results, (shape,) if shape else ("float32", "bfloat16"))
        elif name == "pbench":  # the model's kernels are warmed and graphs captured at start: no warm-up pass
            shape, _, layout = shape.partition(":")
            bench(results, shape, 1000, 512, 256, baseline=False, extra=[*_LAYOUTS[layout], "--warmup", "0"])
        print(f"[{part}: {time.perf_counter() - start:.0f} s]", flush=True)
        with open(os.path.join(OUT, "device_check.json"), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
