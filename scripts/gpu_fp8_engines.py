"""FP8 W8A8 parts of scripts/gpu_quant.py that time engines side by side in ONE process.

- `pdl`: programmatic dependent launch (tokenmill/layers/triton_ops/pdl.py) on and off.
  1. The decode chain of CHAIN_LAYERS Llama-8B layers without attention (fused add + RMSNorm,
     the fp8 linears qkv / o / gate_up / down, SiLU-and-mul: the engine's modules) at 1 row (the
     stream GEMVs) and 256 rows (W8A8 with the fused quantizations), captured in CUDA graphs with
     PDL off and on (256 rows also without the fused SiLU quantization) and replayed alternately:
     microseconds per layer; the variants' outputs must be bit-identical (a PDL kernel that read
     its input before the wait would race).
  2. Batch-1 engines (max_num_seqs 1: one decode graph), each built after the last one shut down:
     fp8 with PDL, fp8 without, bf16 with PDL (ms per output token; the first two decide whether
     PDL pays for fp8; bf16 runs with it too, since PDL reaches its norm and SiLU kernels).
- `siluquant`: SiLU-and-mul + fp8 quantization of down_proj's input, the two kernels against the
  fused one, at 256 and 8192 rows (checked equal first).
- `pdlplant`: the chain check against a planted race (every kernel's wait removed): it must fail.
- `fp8engines`: the goal figures in one process, every engine warmed on the workload first:
  bf16, fp8 weights, fp8 weights + fp8 KV cache at 256x256x128 and 1000x512x256, batch 1 (bf16
  and fp8). The engines are built one after the other, each shut down before the next;
  GPU_FP8_ENGINES=bf16,fp8 leaves fp8kv out, GPU_FP8_WORKLOADS=256x256x128,1000x512x256 leaves
  batch 1 out, GPU_FP8_REPEATS=3 measures 256x256x128 three times (the median recorded, the runs
  listed). Then each throughput workload's per-step bound (and its serial form) from this
  card's rates measured in the same process (scripts/fp8_engine_bounds.py), beside the measured
  tok/s and the ratios to bf16.

Each engine's figures are written to $OUT/part-<name>-partial.json as they come, so a run cut
by its time limit still leaves what it measured.
"""

from __future__ import annotations

import gc
import json
import os
import time
import traceback

import torch
import triton
import triton.language as tl

CHAIN_LAYERS = 4  # distinct weights: 4 x 218 MB of fp8, far past the 50 MB L2
SMOKE_CHAIN = dict(hidden=128, inter=256, qkv=256)


def _save(results: dict, out: str, name: str) -> None:
    with open(os.path.join(out, f"part-{name}-partial.json"), "w") as f:
        json.dump(results, f, indent=2)


def _chain(device: str, smoke: bool, layers: int):
    """Build the chain's layers from the engine's own modules (Linear with the online fp8 method,
    RMSNorm and SiluAndMul marked as `mark_fused_producers` marks them): the same code paths as
    the engine (batch 1: the stream GEMV; 256 rows: fused norm / SiLU quantization + W8A8).
    Returns (run(x, residual) -> output, the layers' SiLU modules, hidden size, dtype)."""
    from torch import nn

    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.norm import RMSNorm
    from tokenmill.layers.quantization.fp8 import Fp8LinearMethod, mark_fused_producers

    h, inter, qkv = ((SMOKE_CHAIN["hidden"], SMOKE_CHAIN["inter"], SMOKE_CHAIN["qkv"]) if smoke
                     else (4096, 14336, 6144))
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)

    def linear(n, k):
        lin = Linear(k, n, bias=False, device=device, dtype=dt)
        nn.init.normal_(lin.weight, std=k ** -0.5)
        lin.quant_method = Fp8LinearMethod(online=True)
        lin.quant_method.process_weights_after_loading(lin)
        return lin

    model = nn.Module()
    model.layers = nn.ModuleList()
    for _ in range(layers):
        layer = nn.Module()
        layer.input_layernorm, layer.post_attention_layernorm = RMSNorm(h).to(device, dt), RMSNorm(h).to(device, dt)
        layer.self_attn, layer.mlp = nn.Module(), nn.Module()
        layer.self_attn.qkv_proj, layer.self_attn.o_proj = linear(qkv, h), linear(h, h)
        layer.mlp.gate_up_proj, layer.mlp.down_proj, layer.mlp.act = linear(2 * inter, h), linear(h, inter), SiluAndMul()
        layer.mlp.act_feeds_only_down = True  # as LlamaMLP's: down_proj is the product's one reader
        layer.norms_feed_only_linears = True  # as LlamaDecoderLayer's: each norm's one reader is its linear
        model.layers.append(layer)
    mark_fused_producers(model)

    def run(x, residual):
        for layer in model.layers:
            a, residual = layer.input_layernorm.forward_with_residual(x, residual)
            t = layer.self_attn.qkv_proj(a)
            o = layer.self_attn.o_proj(t[:, :h].contiguous())  # attention's place: q stands in for its output
            b, residual = layer.post_attention_layernorm.forward_with_residual(o, residual)
            x = layer.mlp.down_proj(layer.mlp.act(layer.mlp.gate_up_proj(b)))
        return x
    return run, [layer.mlp.act for layer in model.layers], h, dt


def _replays(graphs: dict, outs: dict, x0: torch.Tensor, layers: int, rec: dict, what: str) -> dict:
    """Alternate the graphs (labels -> graph): per round a fresh input and ONE replay of each,
    outputs compared (a PDL kernel reading before its wait would see its graph's buffers from the
    previous input; a later replay would not), then 10 timed replays of each. Best us per layer."""
    labels = list(graphs)
    times = {k: [] for k in labels}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for rep in range(6):
        x0.copy_(torch.randn(x0.shape, device=x0.device, dtype=x0.dtype))
        for k in labels:
            graphs[k].replay()
        torch.cuda.synchronize()
        for k in labels[1:]:
            if not torch.equal(outs[k], outs[labels[0]]):
                rec.setdefault("mismatch", {})[f"{what} {k}"] = (
                    f"rep {rep}: max diff {(outs[k].float() - outs[labels[0]].float()).abs().max().item():.3g}")
        for k in labels:
            ev[0].record()
            for _ in range(10):
                graphs[k].replay()
            ev[1].record()
            torch.cuda.synchronize()
            times[k].append(ev[0].elapsed_time(ev[1]) * 1000 / 10 / layers)
    return {k: min(v) for k, v in times.items()}


def _chain_part(results: dict, device: str, smoke: bool, check, planted: bool = False) -> None:
    """The chain at 1 row (PDL off / on) and 256 rows (PDL off / on, and on without the fused SiLU
    quantization), each variant its own graph; all variants of a row count must agree bitwise."""
    from tokenmill.layers.triton_ops import pdl

    layers = 2 if smoke or planted else CHAIN_LAYERS
    chain_rows = tuple(int(r) for r in os.environ.get("GPU_FP8_CHAIN_ROWS", "1,256").split(",") if r)
    row_counts = (1, 40) if smoke else (1,) if planted else chain_rows
    if not row_counts:
        return
    run, acts, h, dt = _chain(device, smoke, layers)
    rec = results.setdefault("pdl_chain", {})
    rec["layers"] = layers
    for rows in row_counts:
        x0 = torch.randn(rows, h, device=device, dtype=dt)
        res0 = torch.randn(rows, h, device=device, dtype=torch.float32)
        res = res0.clone()

        def body():
            res.copy_(res0)
            return run(x0, res)
        if device != "cuda":
            out = body()
            rec[f"eager_ok_{rows}"] = bool(torch.isfinite(out).all())
            check(rec[f"eager_ok_{rows}"], f"pdl chain at {rows} rows (CPU, interpreter): finite output")
            continue
        variants = {"pdl off": (False, True), "pdl on": (True, True)}
        if rows > 1 and not planted:
            variants["pdl on, silu unfused"] = (True, False)
        graphs, outs = {}, {}
        for label, (on, fused) in variants.items():
            pdl.FORCE = on
            for act in acts:
                act.fp8_out = fused
            for _ in range(2):
                body()  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = body()
            graphs[label], outs[label] = graph, out
        pdl.FORCE = None
        for act in acts:
            act.fp8_out = True
        best = _replays(graphs, outs, x0, layers, rec, f"{rows} rows")
        rec[f"us_per_layer_{rows}"] = best
        print(f"  chain, {rows} rows, {layers} layers, us per layer: " +
              ", ".join(f"{k} {v:.1f}" for k, v in best.items()), flush=True)
        del graphs, outs
    if device != "cuda":
        return
    if planted:
        rec["planted_race_caught"] = "mismatch" in rec
        check("mismatch" in rec, f"planted defect (no wait in any kernel): the chain check catches the race "
              f"({rec.get('mismatch')})")
    else:
        check("mismatch" not in rec, f"pdl chain: graph replays of every variant bit-identical "
              f"({rec.get('mismatch', 'yes')})")


@triton.jit
def _no_wait(USE_PDL: tl.constexpr):
    """The planted defect: `pdl.wait` that does not wait."""
    pass


def plant_part(results: dict, device: str, smoke: bool, check) -> None:
    """The chain check against a planted defect, in its own process (before anything compiles):
    `pdl.wait` replaced by a no-op, so every PDL kernel reads its input while the previous kernel
    may still be writing it. The check must see the outputs differ."""
    from tokenmill.layers.triton_ops import pdl

    pdl.wait = _no_wait
    results["pdl_chain"] = {}
    _chain_part(results, device, smoke, check, planted=True)


def silu_quant_part(results: dict, device: str, smoke: bool, check) -> None:
    """SiLU-and-mul + per-token fp8 quantization of down_proj's input: the two kernels the engine
    ran before against `triton_fp8_fused.silu_and_mul_quant` (same values and codes, checked)."""
    from tokenmill.layers.quantization import fp8_ops
    from tokenmill.layers.quantization.triton_fp8 import quantize_row_groups
    from tokenmill.layers.quantization.triton_fp8_fused import silu_and_mul_quant
    from tokenmill.benchmarks.graph_timing import graph_us
    from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul

    d = SMOKE_CHAIN["inter"] if smoke else 14336
    rec = results.setdefault("silu_quant_us", {})
    for m in ((4, 40) if smoke else (256, 8192)):
        x = torch.randn(m, 2 * d, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        out = silu_and_mul_quant(x, code_dtype=torch.float8_e4m3fn if device == "cuda" else torch.float32)
        ref = silu_and_mul(x)
        rq, rs = quantize_row_groups(ref, d) if device == "cuda" else fp8_ops.quantize_rows(ref)
        q, sc = fp8_ops.attached(out)
        q = q.to(torch.float8_e4m3fn)  # (CPU: the interpreter wrote unrounded float32 codes)
        same = torch.equal(out, ref) and torch.equal(sc, rs) and torch.equal(q.float(), rq.float())
        check(same, f"silu_and_mul_quant at {m} rows: output, scales and codes equal the two kernels'")
        if device != "cuda":
            continue

        def two():
            y = silu_and_mul(x)
            return quantize_row_groups(y, d)
        rec[str(m)] = {"silu": graph_us(lambda: silu_and_mul(x), calls=20),
                       "silu+quant": graph_us(two, calls=20),
                       "fused": graph_us(lambda: silu_and_mul_quant(x), calls=20)}
        print(f"  silu+quant at {m} rows: silu {rec[str(m)]['silu']:.1f} us, silu then quant "
              f"{rec[str(m)]['silu+quant']:.1f}, fused {rec[str(m)]['fused']:.1f}", flush=True)


def _engine(config_dir, shape, smoke: bool, label: str, **kwargs):
    from tokenmill import LLM

    extra = dict(device="cpu", enforce_eager=True, kv_cache_memory_gb=0.05) if smoke else {}
    start = time.perf_counter()
    # max_model_len as gpu_quant.py's engine parts (16k prompts + 272), so the figures compare with theirs
    llm = LLM(config_dir(shape), load_format="dummy", dtype="bfloat16", max_model_len=(1024 if smoke else 16384) + 272,
              disable_log_stats=True,
              enable_prefix_caching=False, **kwargs, **extra)
    up = time.perf_counter() - start
    print(f"  {label}: engine up in {up:.0f} s, {llm.kv_cache_stats()['num_blocks']} KV blocks", flush=True)
    return llm, up


def _set_pdl(on: bool | None) -> None:
    """PDL for the next engine: its worker (this process or a child) reads it at capture."""
    from tokenmill.layers.triton_ops import pdl

    pdl.FORCE = on
    if on is None:
        os.environ.pop(pdl.ENV_VAR, None)
    else:
        os.environ[pdl.ENV_VAR] = "1" if on else "0"


def _free(llm) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pdl_part(results: dict, device: str, smoke: bool, shape: dict, config_dir, out: str, check,
             ms_per_token) -> None:
    for piece in (_chain_part,):  # (the chain's 256 rows time the fused SiLU quantization in place)
        try:
            piece(results, device, smoke, check)
        except Exception as exc:  # noqa: BLE001 - the engines below still run
            traceback.print_exc()
            check(False, f"{piece.__name__} raised {type(exc).__name__}")
        _save(results, out, "pdl")
    rec = results.setdefault("pdl_batch1", {})
    order = [("fp8", True), ("fp8", False), ("bf16", True), ("bf16", False)]  # the last if time is left
    only = os.environ.get("GPU_FP8_PDL_ENGINES")  # e.g. "fp8:on,fp8:off"
    if only:
        order = [(w, on == "on") for w, on in (item.split(":") for item in only.split(","))]
    for weights, on in order[:2] if smoke else order:
        label = f"{weights} pdl {'on' if on else 'off'}"
        _set_pdl(on)
        try:
            llm, up = _engine(config_dir, shape, smoke, label, max_num_seqs=1,
                              **({"quantization": "fp8"} if weights == "fp8" else {}))
            rec[label] = ms_per_token(llm, 16 if smoke else 512, 4 if smoke else 256)
            print(f"  {label}: batch 1 {rec[label]:.3f} ms/token", flush=True)
            _free(llm)
        except Exception as exc:  # noqa: BLE001 - the next engine still runs
            traceback.print_exc()
            check(False, f"{label} engine raised {type(exc).__name__}")
        _save(results, out, "pdl")
    _set_pdl(None)
    for on in ("on", "off"):
        f, b = rec.get(f"fp8 pdl {on}"), rec.get(f"bf16 pdl {on}")
        if f and b:
            rec[f"ratio pdl {on}"] = f / b
            print(f"  batch 1 fp8 / bf16, PDL {on}: {f / b:.3f}", flush=True)


# (label, engine kwargs, workloads) of the goal figures, in this order
# (the fp8 weights + fp8 KV engine before the fp8 one, whose 1000x512x256 with a bf16 KV cache, beyond
# its bound's 1.5x, comes last: a run cut at its limit loses that one first)
FP8_ENGINES = [
    ("bf16", {}, ["256x256x128", "1000x512x256", "batch1"]),
    ("fp8kv", {"quantization": "fp8", "kv_cache_dtype": "fp8"}, ["256x256x128", "1000x512x256"]),
    ("fp8", {"quantization": "fp8"}, ["batch1", "256x256x128", "1000x512x256"]),
]


def engines_part(results: dict, device: str, smoke: bool, shape: dict, config_dir, out: str, throughput,
                 ms_per_token) -> None:
    import fp8_engine_bounds as eb

    scale = (lambda n: max(1, n // 64)) if smoke else (lambda n: n)
    timings = results.setdefault("timings", {})
    results["fp8_rates"] = eb.measure_rates(device)  # first, on an idle card; the bounds follow every figure
    only = os.environ.get("GPU_FP8_ENGINES")  # e.g. "bf16,fp8" (a shorter run without fp8kv)
    only_w = os.environ.get("GPU_FP8_WORKLOADS")  # e.g. "256x256x128,1000x512x256" (no batch 1)
    failed: list[str] = []
    for label, kwargs, workloads in FP8_ENGINES:
        if only and label not in only.split(","):
            continue
        workloads = [w for w in workloads if not only_w or w in only_w.split(",")]
        try:
            llm, up = _engine(config_dir, shape, smoke, label, **kwargs)
        except Exception:  # noqa: BLE001 - the next engine still runs; the part fails at the end
            traceback.print_exc()
            failed.append(label)
            continue
        rec = timings.setdefault(label, {"kv_blocks": llm.kv_cache_stats()["num_blocks"], "engine_up_s": up})
        for w in workloads:
            start = time.perf_counter()
            if w == "batch1":
                rec[w] = ms_per_token(llm, scale(512), scale(256) if not smoke else 4)
            else:
                num, inp, outp = (int(v) for v in w.split("x"))
                # GPU_FP8_REPEATS: 256x256x128 (a 4-second run) measured that many times, the median recorded
                reps = int(os.environ.get("GPU_FP8_REPEATS", "1")) if w == "256x256x128" else 1
                runs = [throughput(llm, scale(num), scale(inp), scale(outp)) for _ in range(reps)]
                rec[w] = sorted(runs)[len(runs) // 2]
                if reps > 1:
                    rec[w + "_runs"] = runs
            print(f"  {label} {w}: {rec[w]:.2f} {'ms/token' if w == 'batch1' else 'output tok/s'} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            _bounds(results, shape, timings)
            _save(results, out, "fp8engines")
        _free(llm)
    for line in results.get("fp8_bound_lines", []):
        print("  " + line, flush=True)
    if failed:
        raise RuntimeError(f"fp8engines: engine(s) {failed} failed to start")


def _bounds(results: dict, shape: dict, timings: dict) -> None:
    """Each engine's per-step bound from this card's rates (`fp8_engine_bounds`), beside the measured
    tok/s: whether the issue's 1.5x is within what fp8 weights (+ fp8 KV) allow, and how far each is."""
    import fp8_engine_bounds as eb

    rates = results["fp8_rates"]
    bounds = eb.engine_bounds(shape, rates, timings, FP8_ENGINES)
    results["fp8_bounds"] = bounds
    results["fp8_bound_lines"] = eb.bound_lines(bounds, rates)
