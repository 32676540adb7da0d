"""The `b1` part of scripts/gpu_quant.py: where an fp8 batch-1 decode step's weight stream stands.

Kernel level, one process, weights cycled past L2 (`gpu_quant._cycled`: HBM-bound, as in a
forward), CUDA-graph replays (`gpu_quant._time_ms`):
1. the card's copy bandwidth (the floor every figure below is a fraction of);
2. each Llama-8B linear at one row and the LM head (128256 x 4096): bf16 cuBLAS, the fp8
   streaming GEMV with the engine's tiles (`stream_tiles.fp8_tiles`), and a sweep of one-row
   tiles and split-K; microseconds and the fraction of copy bandwidth their bytes reach;
   the winners as `stream_tiles.MEASURED` lines;
3. down_proj with SiLU-and-mul in the GEMV's loads (`silu_x`) against the SiLU kernel + GEMV
   (checked bitwise equal first);
4. the 8-bit LM heads (`lm_head_8bit`, int8 and fp8) against the bf16 head: time, and the logits' error on
   random hidden states (max |difference| over the bf16 logits' spread, top-1 agreement);
5. the decode chain of CHAIN_LAYERS layers at one row (`gpu_fp8_engines._chain`, PDL on) with
   SiLU fused into down_proj's GEMV and without: microseconds per layer, outputs bit-identical;
6. the per-step estimate at batch 1: 32 layers of the chain + the head, engine tiles against
   the best tiles, beside the weight bytes at copy bandwidth.
Every figure is written to $OUT/part-b1-partial.json as it comes.

    python scripts/gpu_fp8_batch1.py --precompile i/n   # (the part compiles its kernels in processes)
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace

import torch

import triton_precompile

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
SMOKE_SHAPES = {"qkv": (256, 128), "o": (128, 128), "gate_up": (512, 128), "down": (128, 256), "lm_head": (320, 128)}
LAYERS = 32  # Llama-3.1-8B
LAYER_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # qkv, o, gate_up, down
CHAIN_PRE = (2, 4)  # chain variants: every GEMV with this many weight tiles before the PDL wait


def one_row_tiles(smoke: bool):
    """Candidate one-row tiles (compiled variants; split-K is a launch size)."""
    from tokenmill.layers.quantization.stream_tiles import Tiles as T
    if smoke:
        return [T(1, 16, 64, warps=2, stages=2, pipe=True), T(1, 32, 64, pipe=True)]
    return [T(1, 16, 256, warps=2, stages=4, pipe=True), T(1, 16, 512, warps=4, stages=3, pipe=True),
            T(1, 32, 256, warps=4, stages=4, pipe=True), T(1, 32, 512, warps=4, stages=3, pipe=True),
            T(1, 16, 256, warps=2, stages=6, pipe=True), T(1, 16, 128, warps=1, stages=6, pipe=True),
            # more weight tiles in flight across the PDL wait (Tiles.pre)
            T(1, 16, 256, warps=2, stages=4, pipe=True, pre=2), T(1, 16, 256, warps=2, stages=4, pipe=True, pre=4),
            T(1, 16, 512, warps=4, stages=3, pipe=True, pre=2), T(1, 32, 256, warps=4, stages=4, pipe=True, pre=2)]


def _splits(n: int, k: int, t, sms: int) -> list[int]:
    tiles = -(-n // t.block_n)
    return [s for s in (1, 2, 4, 8) if k // (s * t.block_k) >= 2 and (s == 1 or tiles < 4 * sms)]


def _compile_calls(device: str, smoke: bool):
    """One small call per compiled variant (sizes multiples of 16, as the timed ones)."""
    from tokenmill.layers.quantization import fp8_ops
    from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_gemm

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    w = torch.randn(1024, 2048, device=device) * 0.02
    q, s = fp8_ops.quantize_rows(w)
    counters = torch.zeros(4096, dtype=torch.int32, device=device)
    x, x2 = torch.randn(1, 2048, device=device, dtype=dt), torch.randn(1, 4096, device=device, dtype=dt)
    calls = []
    for t in one_row_tiles(smoke):
        for split in (1, 2):
            tt = replace(t, split=split)
            calls.append((tt.label(), lambda tt=tt: fp8_stream_gemm(x, q, s, None, counters, tiles=tt)))
        tt = replace(t, split=1)  # the LM head: float32 logits, never split (8016 tiles)
        calls.append((tt.label() + " f32", lambda tt=tt: fp8_stream_gemm(x, q, s, None, counters, tiles=tt,
                                                                          out_dtype=torch.float32)))
    from tokenmill.layers.quantization import stream_tiles
    sms = stream_tiles.sm_count(torch.device(device))
    for n, k in ((4096, 14336), (128256, 4096)):  # the engine's down_proj tiles with SiLU; its head tiles
        tt = stream_tiles.fp8_tiles(1, n, k, None, sms)
        calls.append((tt.label() + " silu", lambda tt=tt: fp8_stream_gemm(x2, q, s, None, counters, tiles=tt,
                                                                           silu_x=True)))
        calls.append((tt.label() + " f32", lambda tt=tt: fp8_stream_gemm(x, q, s, None, counters, tiles=tt,
                                                                          out_dtype=torch.float32)))
    for pre in CHAIN_PRE:  # the chain's variants: the engine's tiles with more tiles before the wait
        for (n, k), silu in zip(LAYER_SHAPES, (False, False, False, True)):
            tt = replace(stream_tiles.fp8_tiles(1, n, k, None, sms), pre=pre)
            calls.append((tt.label(), lambda tt=tt, silu=silu: fp8_stream_gemm(x2 if silu else x, q, s, None, counters,
                                                                                 tiles=tt, silu_x=silu)))
    return calls


def precompile_shard(shard: str) -> None:
    triton_precompile.compile_shard(_compile_calls("cuda", False), shard)


def _read_bandwidth(device: str) -> float:
    """Bytes per second a large read-only pass reaches (a sum over 1 GiB): a GEMV only reads."""
    if device != "cuda":
        return 50e9
    x = torch.ones(1 << 28, dtype=torch.float32, device=device)
    for _ in range(3):
        x.sum()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        x.sum()
    e.record()
    torch.cuda.synchronize()
    return 10 * x.numel() * 4 / (s.elapsed_time(e) / 1e3)


def _save(results: dict, out: str) -> None:
    with open(os.path.join(out, "part-b1-partial.json"), "w") as f:
        json.dump(results, f, indent=2)


def batch1_part(results: dict, device: str, smoke: bool, check, time_ms, cycled, out: str) -> None:
    from tokenmill.layers.quantization import fp8_ops, lm_head_8bit, stream_tiles
    from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_gemm
    from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul

    cuda = device == "cuda"
    if cuda:
        triton_precompile.compile_in_processes(__file__, "--precompile", 8, 30.0, "b1")
    rec = results.setdefault("b1", {})
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_quant_fp8
    bw = gpu_quant_fp8.copy_bandwidth(device)
    rec["copy_tb_s"] = bw / 1e12
    rec["read_tb_s"] = _read_bandwidth(device) / 1e12
    print(f"  copy bandwidth {bw / 1e12:.2f} TB/s (read + write); a read-only reduction {rec['read_tb_s']:.2f} TB/s",
          flush=True)
    sms = stream_tiles.sm_count(torch.device(device))
    dt = torch.bfloat16 if cuda else torch.float32
    shapes = SHAPES if not smoke else SMOKE_SHAPES
    engine_us, best_us, bf16_us, lines = {}, {}, {}, []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=dt) * 0.02
        q, s = fp8_ops.quantize_rows(w)
        if not cuda:
            q = q.float()
        fp8_w, bf16_w = cycled([q, s]), cycled([w])
        counters = stream_tiles.SplitCounters(n, torch.device(device)).tensor
        x = torch.randn(1, k, device=device, dtype=dt)
        out_dtype = torch.float32 if name == "lm_head" else None
        r = {}
        if name == "lm_head":  # the engine's bf16 head: float32 logits from cuBLAS (`ParallelLMHead`)
            r["bf16"] = 1000 * time_ms(lambda: _f32_mm(x, bf16_w()[0]), device)
        else:
            r["bf16"] = 1000 * time_ms(lambda: x @ bf16_w()[0].t(), device)
        engine = stream_tiles.fp8_tiles(1, n, k, None, sms)
        r["engine " + engine.label()] = 1000 * time_ms(
            lambda: fp8_stream_gemm(x, *fp8_w(), None, counters, out_dtype=out_dtype), device)
        for t in one_row_tiles(smoke):
            for split in _splits(n, k, t, sms):
                tt = replace(t, split=split)
                try:
                    r[tt.label()] = 1000 * time_ms(
                        lambda tt=tt: fp8_stream_gemm(x, *fp8_w(), None, counters, tiles=tt, out_dtype=out_dtype), device)
                except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                    print(f"    {tt.label()}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    torch.cuda.synchronize() if cuda else None
        fp8_bytes = n * k + 4 * n
        best = min((v, lab) for lab, v in r.items() if lab != "bf16")
        engine_us[name], best_us[name], bf16_us[name] = r["engine " + engine.label()], best[0], r["bf16"]
        rec[name] = {"us": r, "fp8_bytes": fp8_bytes, "best": best[1],
                     "engine_fraction_of_copy": fp8_bytes / (engine_us[name] * 1e-6) / bw,
                     "best_fraction_of_copy": fp8_bytes / (best[0] * 1e-6) / bw,
                     "bf16_fraction_of_copy": 2 * n * k / (r["bf16"] * 1e-6) / bw}
        print(f"  {name} {n}x{k}, 1 row: bf16 {r['bf16']:.1f} us ({rec[name]['bf16_fraction_of_copy']:.0%} of copy), "
              f"fp8 engine tiles {engine_us[name]:.1f} ({rec[name]['engine_fraction_of_copy']:.0%}), best {best[1]} "
              f"{best[0]:.1f} ({rec[name]['best_fraction_of_copy']:.0%})", flush=True)
        print("    " + ", ".join(f"{lab} {v:.1f}" for lab, v in sorted(r.items(), key=lambda kv: kv[1])), flush=True)
        if best[1] != "bf16" and not best[1].startswith("engine"):
            lines.append(f"    ('fp8', 1, {n}, {k}): {stream_tiles.Tiles.parse(best[1]).code()},  # {best[0]:.1f} us")
        if name == "down":  # SiLU-and-mul in the GEMV's loads against the two kernels
            xg = torch.randn(1, 2 * k, device=device, dtype=dt) * 2
            fused = fp8_stream_gemm(xg, q, s, None, counters, silu_x=True)
            plain = fp8_stream_gemm(silu_and_mul(xg), q, s, None, counters)
            check(torch.equal(fused, plain), "down_proj GEMV with silu_x equals SiLU-and-mul then the GEMV (bitwise)")
            rec["down_silu"] = {
                "fused_us": 1000 * time_ms(lambda: fp8_stream_gemm(xg, *fp8_w(), None, counters, silu_x=True), device),
                "two_kernels_us": 1000 * time_ms(lambda: fp8_stream_gemm(silu_and_mul(xg), *fp8_w(), None, counters),
                                                 device)}
            print(f"  down_proj + SiLU-and-mul, 1 row: fused {rec['down_silu']['fused_us']:.1f} us, two kernels "
                  f"{rec['down_silu']['two_kernels_us']:.1f}", flush=True)
        if name == "lm_head":
            _head_error(rec, w, device, dt, lm_head_8bit, check)
        del w, q, s, fp8_w, bf16_w
        _save(results, out)
    if lines:
        print("  MEASURED lines (stream_tiles) for this card:\n" + "\n".join(lines), flush=True)
    rec["measured_lines"] = lines
    try:
        _chain(rec, device, smoke, check)
    except Exception as exc:  # noqa: BLE001 - the estimate below still prints
        import traceback
        traceback.print_exc()
        check(False, f"b1 chain raised {type(exc).__name__}")
    _save(results, out)
    layer = ("qkv", "o", "gate_up", "down")
    wbytes = LAYERS * sum(rec[nm]["fp8_bytes"] for nm in layer) + rec["lm_head"]["fp8_bytes"]
    est = {"weights_at_copy_us": wbytes / bw * 1e6,
           "gemvs_engine_us": LAYERS * sum(engine_us[nm] for nm in layer),
           "gemvs_best_us": LAYERS * sum(best_us[nm] for nm in layer),
           "bf16_gemms_us": LAYERS * sum(bf16_us[nm] for nm in layer),
           "head_bf16_us": bf16_us["lm_head"], "head_fp8_us": best_us["lm_head"]}
    rec["step_estimate"] = est
    print("  batch-1 step, weights only (32 layers' GEMVs + head): " + ", ".join(f"{k2} {v:,.0f}" for k2, v in est.items()),
          flush=True)
    _save(results, out)
    try:
        _tiny_decode(rec, device, check)
    except Exception as exc:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        check(False, f"b1 tiny decode raised {type(exc).__name__}")
    _save(results, out)


def _tiny_decode(rec: dict, device: str, check) -> None:
    """An engine end to end (tiny random Llama, fp8 W8A8, graphs, the int8 LM head forced on): each
    greedy token's logprob from the batch-1 decode steps (SiLU in down_proj's GEMV, the int8 head)
    against the same token's prompt logprob when prompt + output are prefilled again (W8A8 GEMMs,
    the bf16 head). They may differ by the two paths' roundings only."""
    import tempfile

    from tests.helpers.tiny_models import make_tiny_model_dir
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.quantization import lm_head_8bit

    root = tempfile.mkdtemp(prefix="b1-tiny-")
    path = make_tiny_model_dir("llama", root, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                               num_key_value_heads=2)
    lm_head_8bit.FORCE = "int8"
    extra = {} if device == "cuda" else {"device": "cpu"}
    real_attach, attached = lm_head_8bit.attach, 0

    def counting_attach(model):
        nonlocal attached
        ok = real_attach(model)
        attached += ok
        return ok
    lm_head_8bit.attach = counting_attach
    try:
        llm = LLM(path, dtype="bfloat16" if device == "cuda" else "float32", quantization="fp8", single_process=True,
                  kv_cache_memory_gb=0.01, max_model_len=128, max_num_seqs=4, **extra)
    finally:
        lm_head_8bit.FORCE, lm_head_8bit.attach = None, real_attach
    prompt = [(i * 37 + 11) % 250 + 3 for i in range(24)]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=16, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    gen = list(out.token_ids)
    decode = [lp[t].logprob for lp, t in zip(out.logprobs, gen)]
    again = llm.generate([{"prompt_token_ids": prompt + gen}],
                         SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    prefill = [lp[t].logprob for lp, t in zip(again.prompt_logprobs[len(prompt):], gen)]
    err = max(abs(a - b) for a, b in zip(decode, prefill))
    rec["tiny_decode"] = {"max_logprob_diff": err, "tokens": len(gen), "fp8_heads_attached": attached}
    print(f"  tiny fp8 engine: {len(gen)} greedy tokens, decode vs prefill logprob max diff {err:.4f}", flush=True)
    check(err < 0.1, f"tiny fp8 engine (int8 head, SiLU in the GEMV): decode logprobs vs prefill, max diff {err:.4f}")
    if device == "cuda":
        check(attached > 0, "tiny fp8 engine: the int8 LM head attached")
    llm.shutdown()


def _f32_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T with float32 output (cuBLAS's mixed-dtype mm where torch has it, as the engine)."""
    if x.is_cuda:
        try:
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            pass
    return (x @ w.t()).float()


def _head_error(rec: dict, w: torch.Tensor, device: str, dt, lm_head_8bit, check) -> None:
    """The 8-bit heads' logits against the bf16 head's on 16 random unit-variance hidden states, and
    the int8 head's time at one row (the fp8 head's is the sweep above)."""
    h = torch.randn(16, w.shape[1], device=device, dtype=dt)
    ref = _f32_mm(h, w)
    spread = ref.std().item()
    for kind in lm_head_8bit.KINDS:
        head = lm_head_8bit.quantize_head(w, kind)
        if device != "cuda":
            head.weight = head.weight.float()
        got = torch.cat([head.logits(h[i:i + 1]) for i in range(h.shape[0])])
        err = (got - ref).abs().max().item() / spread
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        r = {"max_abs_over_std": err, "rms_over_std": ((got - ref).pow(2).mean().sqrt() / spread).item(),
             "top1_agreement": top1}
        if kind == "int8" and device == "cuda":
            from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_gemm
            import gpu_quant
            x = h[:1].contiguous()
            r["us"] = 1000 * gpu_quant._time_ms(lambda: fp8_stream_gemm(x, head.weight, head.scale, None,
                                                                         head.counters.tensor,
                                                                         out_dtype=torch.float32), device)
        rec[f"lm_head_{kind}_error"] = r
        print(f"  {kind} LM head vs bf16 head, 16 random rows: max |diff| {err:.3f} of the logits' std, "
              f"rms {r['rms_over_std']:.4f}, top-1 agreement {top1:.2f}" +
              (f"; {r['us']:.1f} us at one row" if "us" in r else ""), flush=True)
        check(err < 0.25, f"{kind} LM head logits within 0.25 std of the bf16 head's (max {err:.3f})")


def _chain(rec: dict, device: str, smoke: bool, check) -> None:
    """The decode chain at one row, PDL as the engine runs it, SiLU fused into down_proj's GEMV or not."""
    import gpu_fp8_engines
    from tokenmill.layers.quantization import fp8

    layers = 2 if smoke else gpu_fp8_engines.CHAIN_LAYERS
    run, acts, h, dt = gpu_fp8_engines._chain(device, smoke, layers)
    x0 = torch.randn(1, h, device=device, dtype=dt)
    res0 = torch.randn(1, h, device=device, dtype=torch.float32)
    res = res0.clone()

    def body():
        res.copy_(res0)
        return run(x0, res)
    if device != "cuda":
        fp8.FUSE_SILU_GEMV = False
        a = body()
        fp8.FUSE_SILU_GEMV = True
        check(torch.allclose(a, body(), atol=1e-5), "b1 chain (CPU): SiLU deferred or not, the same output")
        return
    from tokenmill.layers.quantization import stream_tiles

    graphs, outs = {}, {}
    sms = stream_tiles.sm_count(torch.device(device))
    saved = dict(stream_tiles.MEASURED)
    variants = [("silu in down GEMV", True, 1), ("silu kernel", False, 1)]
    variants += [(f"silu in GEMV, pre {p}", True, p) for p in CHAIN_PRE]
    for label, fused, pre in variants:
        fp8.FUSE_SILU_GEMV = fused
        for n, k in LAYER_SHAPES:  # the tiles the layers pick at capture (`stream_tiles.fp8_tiles`)
            stream_tiles.MEASURED[("fp8", 1, n, k)] = replace(stream_tiles.fp8_tiles(1, n, k, None, sms), pre=pre)
        try:
            for _ in range(2):
                body()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = body()
            graphs[label], outs[label] = graph, out
        finally:
            stream_tiles.MEASURED.clear()
            stream_tiles.MEASURED.update(saved)
    fp8.FUSE_SILU_GEMV = True
    chain: dict = {"layers": layers}
    best = gpu_fp8_engines._replays(graphs, outs, x0, layers, chain, "1 row")
    chain["us_per_layer"] = best
    rec["chain"] = chain
    print("  chain, 1 row, us per layer: " + ", ".join(f"{k} {v:.1f}" for k, v in best.items()), flush=True)
    check("mismatch" not in chain, f"b1 chain: SiLU in the GEMV and the pre variants bit-identical to the SiLU kernel "
          f"({chain.get('mismatch', 'yes')})")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--precompile":
        os.environ.setdefault("TRITON_INTERPRET", "0")
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        precompile_shard(sys.argv[2])
