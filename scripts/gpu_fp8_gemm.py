"""The `w8a8tma` part of scripts/gpu_quant.py: the W8A8 GEMM of each Llama-8B linear (qkv, o,
gate_up, down) at the engine's row counts, row-wise `torch._scaled_mm` (cuBLASLt), the engine's
current path (`fp8._w8a8_mm` through `stream_tiles.W8A8_MEASURED`) and the TMA-fed Triton GEMM
(`triton_fp8_tma`) at its tiles (plain, swapped operands, split-K, persistent), every variant
checked against the torch reference first, weights cycled past L2 (as in a model's forward), each
time a CUDA-graph replay of 20 calls. After the first row count (256), its winners run in the
engine's own decode-layer chain beside the current table (`chain_ab`), and the fused producers
of W8A8 inputs (SiLU-and-mul, add + RMSNorm) are timed with and without their bf16 output
(`producer_times`; W8A8TMA_PRODUCERS=0 skips them). Rows in the order 256 (the decode batch of both goal
workloads), 8192 (their prefill chunks), 1024, 512, 128, 64, each shape's records written to
$OUT/part-w8a8tma-partial.json as they come (a run cut at its limit keeps them). Ends with the
`W8A8_MEASURED` lines of the winners (the fastest of row-wise, the engine's and the TMA tiles).

W8A8TMA_BUDGET_S caps the timing loop (default 45 s); W8A8TMA_ROWS picks the row counts;
W8A8TMA_TABLE_ONLY=1 times only the TMA tiles `stream_tiles.W8A8_MEASURED` names (a short run that
checks and times the engine's choices on the card at hand).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch

import triton_precompile  # scripts/: compiles a sweep's kernels in parallel processes

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOKE_SHAPES = {"qkv": (96, 128), "o": (64, 128), "gate_up": (256, 128), "down": (64, 256)}
ROWS = (256, 8192, 1024, 512, 128, 64)


def candidates(m: int, smoke: bool) -> list:
    """The TMA tiles (split 1; the sweep adds the splits that fit) tried at m rows."""
    from tokenmill.layers.quantization.triton_fp8_tma import TmaTiles as T

    if smoke:
        return [T(16, 32, 64, 2, 4, 2), T(16, 32, 64, 2, 4, 2, swap=True), T(16, 32, 64, 2, 4, 2, persistent=True)]
    if m <= 128:
        return [T(64, 128, 128, 8, 4, 4, swap=True), T(m, 128, 128, 8, 4, 4, swap=True),
                T(m, 128, 128, 8, 8, 4, swap=True), T(64, 64, 128, 8, 4, 4), T(64, 128, 128, 8, 4, 4),
                T(m, 64, 128, 8, 4, 5, swap=True)]
    if m <= 1024:
        return [T(128, 128, 128, 8, 8, 4), T(128, 256, 128, 8, 8, 4), T(128, 256, 128, 8, 8, 3),
                T(256, 128, 128, 8, 8, 4), T(64, 256, 128, 8, 4, 4), T(256, 128, 128, 8, 8, 4, swap=True),
                T(256, 128, 128, 8, 8, 3, swap=True), T(256, 64, 128, 8, 4, 4, swap=True),
                T(128, 128, 128, 8, 8, 4, swap=True), T(128, 128, 128, 8, 8, 3), T(256, 64, 128, 8, 4, 2, swap=True),
                T(128, 256, 128, 8, 8, 4, persistent=True),
                T(256, 128, 128, 8, 8, 4, swap=True, persistent=True), T(128, 128, 128, 8, 8, 4, persistent=True)]
    return [T(128, 256, 128, 8, 8, 4), T(256, 128, 128, 8, 8, 4), T(128, 256, 128, 8, 8, 4, persistent=True),
            T(256, 128, 128, 8, 8, 4, swap=True, persistent=True), T(128, 128, 128, 8, 8, 4, persistent=True)]


def splits(tiles_mn: int, k: int, block_k: int, sms: int) -> list[int]:
    """Split-K counts worth timing: 1, and those that bring an under-filled grid to <= 2.5 waves
    with >= 4 K steps per slice."""
    out = [1]
    if tiles_mn < sms:
        for s in (2, 3, 4, 6, 8):
            if tiles_mn * s <= 2.5 * sms and k // (s * block_k) >= 4:
                out.append(s)
    return out


def _variants(m: int, n: int, k: int, sms: int, smoke: bool) -> list:
    from dataclasses import replace

    from tokenmill.layers.quantization import stream_tiles
    from tokenmill.layers.quantization.triton_fp8_tma import TmaTiles

    if os.environ.get("W8A8TMA_TABLE_ONLY") == "1":  # the final run: only the TMA tiles the table names
        entry = stream_tiles.W8A8_MEASURED.get((stream_tiles.w8a8_bucket(m), n, k))
        return [TmaTiles.parse(entry)] if isinstance(entry, str) and entry.startswith("tma-") else []
    out = []
    for t in candidates(m, smoke):
        tiles_mn = -(-m // t.block_m) * -(-n // t.block_n)
        for s in ([1, 2] if smoke else splits(tiles_mn, k, t.block_k, sms)):
            out.append(replace(t, split=s))
    return out


def _compile_calls(device: str):
    """Every variant once on a small problem of the same specialization (sizes multiples of 16)."""
    from tokenmill.layers.quantization import fp8_ops
    from tokenmill.layers.quantization.triton_fp8_tma import fp8_gemm_tma

    n, k = 1024, 2048
    wq, ws = fp8_ops.quantize_rows(torch.randn(n, k, device=device) * 0.02)
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    seen, calls = set(), []
    for m in ROWS:
        xq, xs = fp8_ops.quantize_rows(torch.randn(m, k, device=device))
        for name, (nn_, kk) in SHAPES.items():
            for t in _variants(m, nn_, kk, 132, False):
                key = (t.block_m, t.block_n, t.block_k, t.warps, t.stages, t.split > 1, t.swap, t.persistent, t.ws)
                if key not in seen:
                    seen.add(key)
                    calls.append((t.label(), lambda t=t, xq=xq, xs=xs: fp8_gemm_tma(
                        xq, xs, wq, ws, torch.bfloat16, t, counters=counters)))
    from tokenmill.layers.quantization import stream_tiles
    from tokenmill.layers.quantization.triton_fp8 import quantize_row_groups
    from tokenmill.layers.quantization.triton_fp8_gemm import fp8_gemm

    for t in graph_check_tiles():
        key = (t.block_m, t.block_n, t.block_k, t.warps, t.stages, t.split > 1, t.swap, t.persistent, t.ws)
        if key not in seen:
            seen.add(key)
            calls.append((t.label(), lambda t=t: fp8_gemm_tma(xq, xs, wq, ws, torch.bfloat16, t, counters=counters)))

    for entry in set(v for v in stream_tiles.W8A8_MEASURED.values() if isinstance(v, tuple)):  # the engine path's
        calls.append((f"table {entry}", lambda e=entry: fp8_gemm(xq, xs, wq, ws, torch.bfloat16, *e[:6],
                                                                split=e[6] if len(e) > 6 else 1, counters=counters)))
    xb = torch.randn(2, 4096, device=device, dtype=torch.bfloat16)
    calls.append(("quantize_rows", lambda: quantize_row_groups(xb, 4096)))
    if os.environ.get("W8A8TMA_PRODUCERS", "1") == "1":  # `producer_times`' kernels (rows are not specialized)
        from tokenmill.layers.quantization.triton_fp8_fused import rms_norm_quant, silu_and_mul_quant
        from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm
        from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul

        x = torch.randn(2, 2 * 14336, device=device, dtype=torch.bfloat16)
        h = torch.randn(2, 4096, device=device, dtype=torch.bfloat16)
        res = torch.randn(2, 4096, device=device)
        w = torch.ones(4096, device=device, dtype=torch.bfloat16)
        calls += [("silu", lambda: silu_and_mul(x)), ("silu_quant", lambda: silu_and_mul_quant(x)),
                  ("silu_quant codes", lambda: silu_and_mul_quant(x, write_out=False)),
                  ("add_norm", lambda: fused_add_rms_norm(h, res, w, 1e-5)),
                  ("add_norm_quant", lambda: rms_norm_quant(h, res, w, 1e-5, torch.bfloat16)),
                  ("add_norm_quant codes", lambda: rms_norm_quant(h, res, w, 1e-5, torch.bfloat16, write_out=False)),
                  ("norm_quant", lambda: rms_norm_quant(h, None, w, 1e-5, torch.bfloat16)),
                  ("norm_quant codes", lambda: rms_norm_quant(h, None, w, 1e-5, torch.bfloat16, write_out=False))]
    return calls


def precompile_shard(shard: str) -> None:
    triton_precompile.compile_shard(_compile_calls("cuda"), shard)


def _save(results: dict, out: str) -> None:
    with open(os.path.join(out, "part-w8a8tma-partial.json"), "w") as f:
        json.dump(results, f, indent=2)


TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, pad_token_id=2)


def engine_codes_check(results: dict, device: str, smoke: bool, config_dir, check) -> None:
    """A tiny random Llama engine with fp8 W8A8 (online; one process, eager, so the flag below
    reaches its modules): greedy tokens and prompt logprobs of 40-token prompts (past the streaming
    rows: the fused norm / SiLU quantization runs) with the producers writing codes only
    (`fp8.CODES_ONLY`, the default) and with their bf16 outputs written too: bitwise the same. A
    reader of a codes-only output other than its linear would read unwritten memory and differ."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.quantization import fp8

    if config_dir is None:
        return
    extra = dict(device="cpu", kv_cache_memory_gb=0.05) if smoke else dict(num_gpu_blocks_override=512)
    llm = LLM(config_dir(TINY), load_format="dummy", dtype="bfloat16" if not smoke else "float32",
              quantization="fp8", max_model_len=256, enforce_eager=True, single_process=True,
              enable_prefix_caching=False, disable_log_stats=True, **extra)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (40,), generator=g).tolist()} for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1, ignore_eos=True, detokenize=False)
    got = {}
    try:
        for on in (True, False):
            fp8.CODES_ONLY = on
            outs = llm.generate(prompts, params, use_tqdm=False)
            got[on] = [(o.outputs[0].token_ids, [sorted((k, v.logprob) for k, v in (lp or {}).items())
                                                 for lp in o.prompt_logprobs]) for o in outs]
    finally:
        fp8.CODES_ONLY = True
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    same = got[True] == got[False]
    results["w8a8tma_codes_only_engine_same"] = same
    check(same, "tiny fp8 engine: codes-only producers give bitwise the tokens and prompt logprobs of bf16-writing ones")


def graph_check_tiles() -> tuple:
    """`graph_check`'s TMA tiles (split-K swapped, persistent)."""
    from tokenmill.layers.quantization.triton_fp8_tma import TmaTiles
    return (TmaTiles(256, 128, 128, 8, 8, 4, split=4, swap=True), TmaTiles(128, 256, 128, 8, 8, 4, persistent=True))


def graph_check(results: dict, device: str, check) -> None:
    """The engine's W8A8 call (`fp8._w8a8_mm`) with a TMA entry in the table, captured in a CUDA
    graph (host-side descriptors captured with it), replayed on fresh inputs: every replay equals
    the torch reference and leaves the split-K counters zeroed."""
    from types import SimpleNamespace

    from tokenmill.layers.quantization import fp8_ops, stream_tiles
    from tokenmill.layers.quantization.fp8 import _w8a8_mm
    from tokenmill.layers.quantization.triton_fp8_tma import TmaTiles

    cuda = device == "cuda"
    m, n, k = (256, 4096, 4096) if cuda else (40, 64, 256)  # (CPU smoke: the interpreter, calls for replays)
    w = torch.randn(n, k, device=device) * 0.02
    wq, ws = fp8_ops.quantize_rows(w)
    counters = stream_tiles.SplitCounters(n, torch.device(device)).tensor
    layer = SimpleNamespace(weight=wq if cuda else wq.float(), weight_scale=ws, scale_row=ws.reshape(1, -1).contiguous(),
                            scale_one=torch.ones((), device=device), stream_counters=SimpleNamespace(tensor=counters))
    dt = torch.bfloat16 if cuda else torch.float32
    saved = dict(stream_tiles.W8A8_MEASURED)
    ok = True
    tiles = graph_check_tiles() if cuda else (TmaTiles(16, 32, 64, 2, 4, 2, split=2, swap=True),
                                              TmaTiles(16, 32, 64, 2, 4, 2, persistent=True))
    try:
        for t in tiles:
            stream_tiles.W8A8_MEASURED[(stream_tiles.w8a8_bucket(m), n, k)] = t.label()
            xq, xs = fp8_ops.quantize_rows(torch.randn(m, k, device=device))
            if not cuda:
                xq = xq.float()
            _w8a8_mm(layer, xq, xs, dt)
            if cuda:
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = _w8a8_mm(layer, xq, xs, dt)
            for rep in range(3):
                q, s = fp8_ops.quantize_rows(torch.randn(m, k, device=device) * (rep + 1))
                xq.copy_(q)
                xs.copy_(s)
                if cuda:
                    graph.replay()
                    torch.cuda.synchronize()
                else:
                    out = _w8a8_mm(layer, xq, xs, dt)
                ref = fp8_ops.scaled_mm_reference(xq, xs, wq, ws, torch.float32)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                good = err < 1e-2 and not counters.any()
                ok &= good
                if not good:
                    print(f"  w8a8tma graph check {t.label()} replay {rep}: rel err {err:.1e}, counters "
                          f"zeroed {not counters.any()}", flush=True)
    finally:
        stream_tiles.W8A8_MEASURED.clear()
        stream_tiles.W8A8_MEASURED.update(saved)
    results["w8a8tma_graph_check"] = ok
    check(ok, "w8a8tma: the engine's W8A8 call through TMA tiles, graph-captured, equals the reference on 3 replays")


def chain_ab(results: dict, device: str, smoke: bool, labels: dict, rows: int = 256, layers: int = 4) -> None:
    """The decode chain of `layers` Llama-8B layers without attention (the engine's modules: fused
    norm / SiLU quantization, the four fp8 linears; scripts/gpu_fp8_engines._chain) at `rows`
    rows, each variant of the W8A8 table captured in its own CUDA graph: every linear on row-wise
    `_scaled_mm` (last session's path at 256 rows), the table as it is, and each shape's sweep
    winner at this bucket (`labels`: (n, k) -> table entry; left out where it is the table);
    and the table with SiLU-and-mul writing its bf16 product beside the codes (`fp8.CODES_ONLY`
    off: the output must be bitwise the table's); replayed alternately, best of 6 rounds of 10
    replays, us per layer; each output's relative difference from the `_scaled_mm` one (GEMM orders
    differ: not bitwise)."""
    import gpu_fp8_engines

    from tokenmill.layers.quantization import fp8, stream_tiles

    run, _, h, dt = gpu_fp8_engines._chain(device, smoke, layers)
    x0 = torch.randn(rows, h, device=device, dtype=dt)
    res0 = torch.randn(rows, h, device=device, dtype=torch.float32)
    res = res0.clone()

    def body():
        res.copy_(res0)
        return run(x0, res)
    saved = dict(stream_tiles.W8A8_MEASURED)
    bucket = stream_tiles.w8a8_bucket(rows)
    shapes = SMOKE_SHAPES if smoke else SHAPES
    variants = {"scaled_mm": {nk: "scaled_mm" for nk in shapes.values()},
                "table": {nk: saved.get((bucket, *nk), "scaled_mm") for nk in shapes.values()}}
    best = {nk: labels.get(nk, variants["table"][nk]) for nk in shapes.values()}
    if best != variants["table"]:
        variants["sweep best"] = best
    variants["table, producers write bf16 too"] = variants["table"]  # fp8.CODES_ONLY off: same codes, more traffic
    graphs, outs = {}, {}
    try:
        for variant, entries in variants.items():
            for (n, k), entry in entries.items():
                stream_tiles.W8A8_MEASURED[(bucket, n, k)] = entry
            fp8.CODES_ONLY = variant != "table, producers write bf16 too"
            for _ in range(2):
                body()
            if device != "cuda":
                outs[variant] = body().clone()
                continue
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs[variant] = body()
            graph.replay()
            torch.cuda.synchronize()
            graphs[variant] = graph
    finally:
        stream_tiles.W8A8_MEASURED.clear()
        stream_tiles.W8A8_MEASURED.update(saved)
        fp8.CODES_ONLY = True
    rec = results.setdefault("w8a8tma_chain", {})
    rec[f"codes_only_bitwise_{rows}"] = torch.equal(outs["table"], outs["table, producers write bf16 too"])
    ref = outs["scaled_mm"].float()
    rec[f"rel_diff_{rows}"] = {v: ((o.float() - ref).norm() / ref.norm()).item() for v, o in outs.items()}
    rec[f"entries_{rows}"] = {v: {f"{n}x{k}": e for (n, k), e in entries.items()} for v, entries in variants.items()}
    if device != "cuda":
        return
    times = {k: [] for k in graphs}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for _ in range(6):
        for label, graph in graphs.items():
            ev[0].record()
            for _ in range(10):
                graph.replay()
            ev[1].record()
            torch.cuda.synchronize()
            times[label].append(ev[0].elapsed_time(ev[1]) * 1000 / 10 / layers)
    fastest = {k: min(v) for k, v in times.items()}
    rec[f"us_per_layer_{rows}"] = fastest
    print(f"  w8a8tma chain, {rows} rows, {layers} layers (norms, quantization, 4 fp8 linears), us per layer: "
          + ", ".join(f"{k} {v:.1f}" for k, v in fastest.items()) + "; relative difference from scaled_mm's output: "
          + ", ".join(f"{k} {v:.1e}" for k, v in rec[f"rel_diff_{rows}"].items()), flush=True)
    for v, entries in variants.items():
        print(f"    {v}: " + ", ".join(f"{n}x{k} {e}" for (n, k), e in entries.items()), flush=True)


def producer_times(results: dict, device: str, time_ms, check) -> None:
    """The fused producers of W8A8 inputs at 256 and 8192 rows: SiLU-and-mul (bf16, the engine's
    bf16 kernel) against silu_and_mul_quant writing its bf16 output and codes, or codes only; the
    fused add + RMSNorm against rms_norm_quant with and without its bf16 output. Codes checked
    equal between the two forms first."""
    from tokenmill.layers.quantization import fp8_ops
    from tokenmill.layers.quantization.triton_fp8_fused import rms_norm_quant, silu_and_mul_quant
    from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm
    from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul

    if device != "cuda":
        return
    rec = results.setdefault("w8a8tma_producers_us", {})
    bf = torch.bfloat16
    for m in (256, 8192):
        x = torch.randn(m, 2 * 14336, device=device, dtype=bf)
        h = torch.randn(m, 4096, device=device, dtype=bf)
        res = torch.randn(m, 4096, device=device)
        w = torch.ones(4096, device=device, dtype=bf)
        a, b = fp8_ops.attached(silu_and_mul_quant(x)), fp8_ops.attached(silu_and_mul_quant(x, write_out=False))
        same = torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
        a = fp8_ops.attached(rms_norm_quant(h, None, w, 1e-5, bf))
        b = fp8_ops.attached(rms_norm_quant(h, None, w, 1e-5, bf, write_out=False))
        same &= torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
        check(same, f"producers m={m}: codes-only forms write the same codes and scales")
        r = {"silu": time_ms(lambda: silu_and_mul(x), device),
             "silu_quant": time_ms(lambda: silu_and_mul_quant(x), device),
             "silu_quant codes only": time_ms(lambda: silu_and_mul_quant(x, write_out=False), device),
             "add_norm": time_ms(lambda: fused_add_rms_norm(h, res, w, 1e-5), device),
             "add_norm_quant": time_ms(lambda: rms_norm_quant(h, res, w, 1e-5, bf), device),
             "add_norm_quant codes only": time_ms(lambda: rms_norm_quant(h, res, w, 1e-5, bf, write_out=False), device)}
        rec[str(m)] = {k: v * 1e3 for k, v in r.items()}
        print(f"  producers m={m}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in r.items()), flush=True)


def sweep(results: dict, device: str, time_ms, cycled, check, out: str, config_dir=None) -> None:
    """time_ms(fn, device), cycled(tensors), check(ok, what) and config_dir(shape) come from gpu_quant.py."""
    from types import SimpleNamespace

    from tokenmill.layers.quantization import fp8_ops, stream_tiles
    from tokenmill.layers.quantization.fp8 import _w8a8_mm
    from tokenmill.layers.quantization.triton_fp8 import quantize_row_groups
    from tokenmill.layers.quantization.triton_fp8_tma import fp8_gemm_tma

    cuda = device == "cuda"
    smoke = not cuda
    shapes = SHAPES if cuda else SMOKE_SHAPES
    rows = tuple(int(r) for r in os.environ.get("W8A8TMA_ROWS", ",".join(map(str, ROWS))).split(",")) if cuda \
        else (40,)
    dt = torch.bfloat16 if cuda else torch.float32
    sms = stream_tiles.sm_count(torch.device(device))
    budget = float(os.environ.get("W8A8TMA_BUDGET_S", "45"))
    # the part's kill time (gpu_quant.py): stop a few seconds before it, keeping what was measured
    kill_at = float(os.environ.get("GPU_QUANT_PART_DEADLINE", "inf"))
    if kill_at - time.time() > 30 or smoke:
        try:
            engine_codes_check(results, device, smoke, config_dir, check)
        except Exception as e:  # noqa: BLE001 - the sweep goes on
            check(False, f"w8a8tma tiny engine raised {type(e).__name__}: {str(e)[:200]}")
    else:
        print(f"  w8a8tma: {kill_at - time.time():.0f} s left, the tiny engine check skipped", flush=True)
    if cuda:
        t0 = time.perf_counter()
        shards = 8 if os.environ.get("W8A8TMA_TABLE_ONLY") == "1" else 14  # (few kernels: fewer processes to start)
        triton_precompile.compile_in_processes(__file__, "--precompile", shards,
                                               min(35.0, 0.6 * budget, 0.4 * (kill_at - time.time())), "w8a8tma")
        budget -= 0.5 * (time.perf_counter() - t0)
    deadline = time.perf_counter() + min(budget, kill_at - time.time() - 4)
    graph_check(results, device, check)
    rec = results.setdefault("w8a8tma", {})
    best: dict = {}
    g = torch.Generator(device=device).manual_seed(0)
    one = torch.ones((), device=device)
    weights = {}
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(dt)
        wq, ws = fp8_ops.quantize_rows(w)
        if not cuda:
            wq = wq.float()
        weights[name] = (cycled([w]), cycled([wq, ws, ws.reshape(1, -1).contiguous()]),
                         stream_tiles.SplitCounters(n, torch.device(device)).tensor)
    for m in rows:
        layer = {}
        winners: dict = {}
        for name, (n, k) in shapes.items():
            if time.perf_counter() > deadline:
                print(f"  w8a8tma: budget spent before m={m} {name}", flush=True)
                _save(results, out)
                return
            bf16_w, fp8_w, counters = weights[name]
            x = torch.randn(m, k, device=device, dtype=dt, generator=g)
            xq, xs = quantize_row_groups(x, k) if cuda else fp8_ops.quantize_rows(x)
            if not cuda:
                xq = xq.float()
            wq, ws, _ = fp8_w()
            ref = fp8_ops.scaled_mm_reference(xq, xs, wq, ws, torch.float32)
            r = {"bf16": time_ms(lambda: x @ bf16_w()[0].t(), device)}
            if cuda:
                r["rowwise"] = time_ms(lambda: (lambda q, s, sr: torch._scaled_mm(
                    xq, q.t(), scale_a=xs, scale_b=sr, out_dtype=dt))(*fp8_w()), device)
                lay = lambda q, s, sr: SimpleNamespace(weight=q, weight_scale=s, scale_row=sr, scale_one=one,
                                                       stream_counters=SimpleNamespace(tensor=counters))
                r["engine"] = time_ms(lambda: _w8a8_mm(lay(*fp8_w()), xq, xs, dt), device)
            for t in _variants(m, n, k, sms, smoke):
                label = t.label()
                try:
                    o = fp8_gemm_tma(xq, xs, wq, ws, dt, t, counters=counters, sms=sms)
                    err = ((o.float() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2 or bool(counters.any()):
                        check(False, f"w8a8tma {label} {name} m={m}: rel err {err:.1e}, counters zeroed "
                                     f"{not counters.any()}")
                        continue
                    r[label] = time_ms(lambda: (lambda q, s, _: fp8_gemm_tma(
                        xq, xs, q, s, dt, t, counters=counters, sms=sms))(*fp8_w()), device)
                except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                    check(False, f"w8a8tma {label} {name} m={m}: {type(e).__name__}: {str(e)[:200]}")
            rec[f"{name}_m{m}"] = {key: v * 1e3 for key, v in r.items()}  # us
            gemms = {key: v for key, v in r.items() if key not in ("bf16",)}
            if not gemms:  # (CPU smoke in table-only mode: nothing fp8 to time)
                continue
            win = min(gemms, key=gemms.get)
            best[(stream_tiles.w8a8_bucket(m), n, k)] = (gemms[win], win)
            for key in ("bf16", "rowwise", "engine"):
                if key in r:
                    layer[key] = layer.get(key, 0.0) + r[key]
            layer["best"] = layer.get("best", 0.0) + gemms[win]
            top = sorted(gemms.items(), key=lambda kv: kv[1])[:4]
            print(f"  w8a8tma {name} {n}x{k} m={m}: bf16 {r['bf16'] * 1e3:.1f} us"
                  + (f", rowwise {r['rowwise'] * 1e3:.1f}, engine {r['engine'] * 1e3:.1f}" if cuda else "")
                  + "; best " + ", ".join(f"{lab} {v * 1e3:.1f}" for lab, v in top), flush=True)
            results.setdefault("w8a8tma_best", {})[f"{name}_m{m}"] = {"label": win, "us": gemms[win] * 1e3}
            if win != "engine":  # (the engine's path: the table's entry stays)
                winners[(n, k)] = "scaled_mm" if win == "rowwise" else win
            _save(results, out)
        results.setdefault("w8a8tma_layer_us", {})[str(m)] = {key: v * 1e3 for key, v in layer.items()}
        print(f"  W8A8 layer m={m}: " + ", ".join(f"{key} {v * 1e3:.1f} us" for key, v in layer.items()), flush=True)
        if m == rows[0] and deadline - time.perf_counter() < 8:
            print("  w8a8tma: too little time left for the chain", flush=True)
        elif m == rows[0]:  # the decode batch: the winners in the engine's own layer chain, beside the table
            try:
                chain_ab(results, device, smoke, winners, rows=m if cuda else 40)
                chain = results["w8a8tma_chain"]
                rel = max(chain[f"rel_diff_{m if cuda else 40}"].values())
                # Not a precision check (the GEMMs are checked one by one against the reference): per-token
                # fp8 rounding over 4 random layers amplifies GEMM-order differences (on an H100 the
                # earlier table's checked kernels end 8.7e-2 from all-_scaled_mm); a broken GEMM ends ~1.
                check(rel < 0.25, f"w8a8tma chain: every variant's output within 0.25 of scaled_mm's ({rel:.1e})")
                check(chain[f"codes_only_bitwise_{m if cuda else 40}"],
                      "w8a8tma chain: producers writing codes only give bitwise the output of producers writing bf16 too")
            except Exception as e:  # noqa: BLE001 - the sweep goes on
                check(False, f"w8a8tma chain raised {type(e).__name__}: {str(e)[:200]}")
            if os.environ.get("W8A8TMA_PRODUCERS", "1") == "1":
                try:
                    producer_times(results, device, time_ms, check)
                except Exception as e:  # noqa: BLE001 - the sweep goes on
                    check(False, f"w8a8tma producers raised {type(e).__name__}: {str(e)[:200]}")
            _save(results, out)
    for (bucket, n, k), (ms, win) in sorted(best.items()):
        print(f"  W8A8_MEASURED     ({bucket}, {n}, {k}): {win!r},  # {ms * 1e3:.1f} us", flush=True)
    _save(results, out)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--precompile":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        os.environ["TRITON_INTERPRET"] = "0"
        precompile_shard(sys.argv[2])
