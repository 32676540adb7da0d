"""Issue 21 on one GPU: the fused MoE kernel, its tile tuning, MoE/MLA parity and benchmarks.

Parts (all by default; --parts a,b to pick):
  kernel   fused MoE vs the per-expert loop, bf16, batch 256 and 8, OLMoE-1B-7B (E=64, H=2048, I=1024,
           top-8) and Qwen3-30B-A3B (E=128, H=2048, I=768, top-8) expert shapes; max error vs the loop;
           the fused MoE captured in a CUDA graph replays to the eager result
  tune     tile grid search for those shapes per batch bucket; writes $OUT/moe_configs/*.json (copy into
           tokenmill/layers/moe/configs/ to use them)
  parity   tiny random configs of every MoE/MLA family, float32 on CUDA (Triton MoE + MLA kernels,
           CUDA graphs), greedy tokens and logprobs vs HF transformers
  bench    dummy weights, bf16, graphs on: OLMoE-1B-7B and Qwen3-30B-A3B (24 of 48 layers: fits an
           H100) at 256 prompts x 256 in x 128 out: output tok/s, decode step time vs the bound
           (weights a step reads: attention, router, the experts the batch activates, LM head; plus
           KV; over the measured copy bandwidth) and, in the Qwen3 engine, one request alone (batch 1): ms per output token vs the floor of
           the active experts' (and every other weight's) bytes
  mla      DeepSeek-V2-Lite shape: batch-256 decode step time and the KV blocks available, next to
           what a plain multi-head cache of the same model would get
  big      1000 x 512 x 256 for both MoE shapes (off by default: --parts ...,big)
  full     the whole Qwen3-30B-A3B (48 layers; an H200): 256 x 256 x 128 vs the bound, batch 1 vs the
           floor, HF transformers on the same work (off by default: --parts full)
  hf       HF transformers (warmed, static batch) on bench's and big's work for both shapes, next to
           tokenmill's figure of the same run (off by default: --parts bench,big,hf); at 1000 x 512 x 256
           HF runs one wave of 256 prompts (the whole does not fit one static batch)
  profile  (off by default) torch.profiler over graph-replayed decode steps: OLMoE-1B-7B at batch 256,
           Qwen3-30B-A3B (24 layers) at batch 1; per-kernel table and group shares (scripts/gpu_moe_profile.py)
  sweep    (off by default) one layer's fused experts in a CUDA graph: torch vs Triton alignment, a tile
           grid at OLMoE T=256 and Qwen3 T=1; best tiles to $OUT/moe_configs_graph/; router A/B; decode attention tiles
  gptoss   gpt-oss (off by default: --parts gptoss): the fused MoE's bias + clamped-SwiGLU variant vs
           the loop at gpt-oss-20b's expert shape (E=32, H=2880, I=2880, top-4), bf16, batch 256 and 8,
           and in a CUDA graph; a tiny gpt-oss (sinks, sliding + full layers) float32 on CUDA with
           graphs vs HF, and its MXFP4 checkpoint (dequantized at load) vs HF on the same values;
           a gpt-oss-20b shape (24 layers, dummy bf16 weights, graphs) at 256 x 256 x 128: output
           tok/s and the decode step vs the bound (active experts' bytes + KV within each layer's
           window, over the copy bandwidth)

    python scripts/gpu_moe.py                 # on an H100: under 8 minutes
    python scripts/gpu_moe.py --smoke         # tiny shapes on CPU (Triton interpreter), no timings that matter
    python scripts/gpu_moe.py --parts gptoss  # gpt-oss only (about 4 minutes on an H100)
Writes $OUT/gpu_moe.json (default ./gpu-out); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

OUT = os.environ.get("OUT", os.path.join(os.getcwd(), "gpu-out"))
FAILURES: list[str] = []

_TOK = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-5)
SHAPES = {
    "olmoe-1b-7b": ("OlmoeConfig", dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                                        num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                                        num_experts_per_tok=8, max_position_embeddings=4096, **_TOK)),
    # 24 of Qwen3-30B-A3B's 48 layers, so weights (~30 GB) and KV fit one H100 with room to spare.
    "qwen3-30b-a3b-24l": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                                 moe_intermediate_size=768, num_hidden_layers=24, num_attention_heads=32,
                                                 num_key_value_heads=4, head_dim=128, num_experts=128,
                                                 num_experts_per_tok=8, norm_topk_prob=True,
                                                 max_position_embeddings=40960, **_TOK)),
    # The whole Qwen3-30B-A3B (48 layers, ~61 GB of bf16 weights): an H200 (`full` part).
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                             moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                             num_key_value_heads=4, head_dim=128, num_experts=128,
                                             num_experts_per_tok=8, norm_topk_prob=True,
                                             max_position_embeddings=40960, **_TOK)),
    "deepseek-v2-lite": ("DeepseekV2Config", dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                                                  moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                                                  num_key_value_heads=16, n_routed_experts=64, num_experts_per_tok=6,
                                                  n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=512,
                                                  q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                                  v_head_dim=128, max_position_embeddings=4096, **_TOK)),
    "gpt-oss-20b": ("GptOssConfig", dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                                         num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                                         head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                                         max_position_embeddings=131072, **_TOK)),
}
SMOKE_SHAPES = {
    "gpt-oss-20b": dict(vocab_size=259, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                        num_experts_per_tok=2, sliding_window=8),
    "olmoe-1b-7b": dict(vocab_size=259, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2),
    "qwen3-30b-a3b-24l": dict(vocab_size=259, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_experts=8, num_experts_per_tok=2),
    "qwen3-30b-a3b": dict(vocab_size=259, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=8, num_experts_per_tok=2),
    "deepseek-v2-lite": dict(vocab_size=259, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                             num_experts_per_tok=2, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                             v_head_dim=16),
}
KERNEL_SHAPES = {"olmoe-1b-7b": (64, 2048, 1024, 8), "qwen3-30b-a3b": (128, 2048, 768, 8)}
GPT_OSS_KERNEL_SHAPE = (32, 2880, 2880, 4)
SMOKE_KERNEL_SHAPES = {"tiny": (8, 64, 32, 2)}


def check(ok: bool, what: str) -> None:
    print(("  ok   " if ok else "  FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def config_dir(shape: str, smoke: bool) -> str:
    import transformers
    from tests.helpers.tiny_models import make_tiny_tokenizer
    cls_name, kwargs = SHAPES[shape]
    if smoke:
        kwargs = {**kwargs, **SMOKE_SHAPES[shape]}
    config = getattr(transformers, cls_name)(**kwargs)
    config.architectures = [cls_name.removesuffix("Config") + "ForCausalLM"]
    path = tempfile.mkdtemp(prefix=f"{shape}-")
    config.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def timed(fn, reps: int, device: str) -> float:
    """Mean seconds per call after one warm-up call."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def _random_moe(e, h, i, k, t, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(t, h, generator=gen) / 2).to(dtype).to(device)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.03).to(dtype).to(device)
    w2 = (torch.randn(e, h, i, generator=gen) * 0.03).to(dtype).to(device)
    logits = torch.randn(t, e, generator=gen).to(device)
    weights, ids = torch.topk(logits.softmax(-1), k, dim=-1)
    return x, w13, w2, weights, ids


def part_kernel(results: dict, smoke: bool, device: str, dtype) -> None:
    from tokenmill.layers.moe.fused_moe import fused_experts
    from tokenmill.layers.moe.torch_experts import experts_reference
    for name, (e, h, i, k) in (SMOKE_KERNEL_SHAPES if smoke else KERNEL_SHAPES).items():
        for t in ((8,) if smoke else (256, 8)):
            x, w13, w2, weights, ids = _random_moe(e, h, i, k, t, dtype, device)
            ref = experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
            out = fused_experts(x, w13, w2, weights, ids)
            err = float((out.float() - ref).abs().max() / ref.abs().max())
            check(err < (2e-2 if dtype == torch.bfloat16 else 1e-3), f"{name} T={t}: fused vs loop relative error {err:.2e}")
            reps = 1 if smoke else 20
            t_fused = timed(lambda: fused_experts(x, w13, w2, weights, ids), reps, device)
            t_loop = timed(lambda: experts_reference(x, w13, w2, weights, ids), reps, device)
            rec = {"fused_ms": t_fused * 1e3, "loop_ms": t_loop * 1e3, "speedup": t_loop / t_fused, "rel_err": err}
            results[f"kernel_{name}_T{t}"] = rec
            print(f"  {name} T={t}: fused {rec['fused_ms']:.3f} ms, per-expert loop {rec['loop_ms']:.3f} ms, "
                  f"{rec['speedup']:.1f}x (goal: >= {4 if t >= 256 else 2}x)")
            if device == "cuda" and t == 8:
                graph = torch.cuda.CUDAGraph()
                static_out = fused_experts(x, w13, w2, weights, ids)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    static_out = fused_experts(x, w13, w2, weights, ids)
                ids.copy_(ids.roll(1, dims=0))
                graph.replay()
                torch.cuda.synchronize()
                check(torch.equal(static_out, fused_experts(x, w13, w2, weights, ids)),
                      f"{name}: the fused MoE replays in a CUDA graph (new routing, no host sync)")


def part_tune(results: dict, smoke: bool, device: str, dtype) -> None:
    from tokenmill.layers.moe.fused_moe import fused_experts
    from tokenmill.layers.moe.tile_configs import TileConfig, config_file_name
    out_dir = os.path.join(OUT, "moe_configs")
    os.makedirs(out_dir, exist_ok=True)
    # 6 tiles x 2 kernels x 2 shapes compile in well under a minute; each bucket then only times.
    tiles = {16: ((64, 128), (128, 64)), 32: ((64, 64), (128, 64)), 64: ((128, 64), (64, 64))}
    candidates = [TileConfig(bm, bn, bk, bn, bk, 8 if bm == 64 else 4, 3) for bm, pairs in tiles.items()
                  for bn, bk in pairs]
    buckets = (1, 8, 64, 256, 1024)
    if smoke:
        candidates, buckets = [TileConfig(16, 32, 32, 32, 32, 4, 2), TileConfig(16, 16, 16, 16, 16, 4, 2)], (8,)
    dname = str(dtype).removeprefix("torch.")
    for name, (e, h, i, k) in (SMOKE_KERNEL_SHAPES if smoke else KERNEL_SHAPES).items():
        table = {}
        for t in buckets:
            x, w13, w2, weights, ids = _random_moe(e, h, i, k, t, dtype, device)
            best = None
            for cfg in candidates:
                try:
                    sec = timed(lambda: fused_experts(x, w13, w2, weights, ids, cfg), 1 if smoke else 10, device)
                except Exception as exc:  # a tile that does not fit (shared memory): skip it
                    print(f"    skip {cfg}: {type(exc).__name__}")
                    continue
                if best is None or sec < best[0]:
                    best = (sec, cfg)
            table[str(t)] = best[1].to_json()
            print(f"  {name} T={t}: best {best[1]} {best[0] * 1e6:.0f} us")
        path = os.path.join(out_dir, config_file_name(e, h, i, dname))
        with open(path, "w") as f:
            json.dump(table, f, indent=1)
        results[f"tune_{name}"] = {"file": path, "table": table}


def part_parity(results: dict, smoke: bool, device: str) -> None:
    from transformers import AutoModelForCausalLM
    from tests.helpers.tiny_moe_models import MLA_ARCHS, MOE_ARCHS, make_tiny_moe_model_dir
    from tests.helpers.moe_reference import check_against_hf, generate, prompts_for
    from tokenmill import LLM
    root = tempfile.mkdtemp(prefix="moe-parity-")
    for arch in (MOE_ARCHS[:1] + MLA_ARCHS[:1]) if smoke else MOE_ARCHS + MLA_ARCHS:
        path = make_tiny_moe_model_dir(arch, root)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts = prompts_for(arch)
        try:
            with LLM(path, dtype="float32", device=device, max_model_len=128, gpu_memory_utilization=0.3,
                     kv_cache_memory_gb=0.01, max_num_batched_tokens=32, max_num_seqs=4) as llm:
                outs = generate(llm, prompts, None)
            check_against_hf(hf, prompts, outs, arch)
            check(True, f"{arch}: float32 on {device} = HF (tokens, logprobs within 1e-4)")
            results[f"parity_{arch}"] = "ok"
        except AssertionError as exc:
            check(False, f"{arch}: {str(exc)[:300]}")
            results[f"parity_{arch}"] = str(exc)[:2000]


def _bandwidth(device: str) -> float:
    if device != "cuda":
        return 1e11
    from tokenmill.benchmarks.roofline import measure_copy_bandwidth
    return measure_copy_bandwidth()


def _step_weight_bytes(arch, batch: int) -> float:
    """Weights a decode step of `batch` rows reads (bf16): every non-expert weight once, and each MoE
    layer's experts that the batch activates (uniform routing; `tokenmill.benchmarks.roofline`)."""
    from tokenmill.benchmarks.roofline import weight_bytes_read_per_step
    return weight_bytes_read_per_step(arch, "bfloat16", batch)


def _engine_run(path: str, device: str, prompts: int, in_len: int, out_len: int, batch1: tuple[int, int] | None = None,
                **engine) -> dict:
    """Output tok/s of `prompts` x in_len x out_len (after a warm-up pass; no prefix cache, so every
    pass prefills) and the decode step time (the run's time less a one-token run's, per step); with `batch1` = (in, out), also one
    request alone: ms per output token."""
    from tokenmill import LLM, SamplingParams
    import random
    rng = random.Random(0)
    reqs = [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(in_len)]} for _ in range(prompts)]
    with LLM(path, load_format="dummy", dtype="bfloat16" if device == "cuda" else "float32", device=device,
             max_model_len=in_len + out_len + 16, max_num_seqs=max(prompts, 1) if prompts <= 256 else 256,
             kv_cache_memory_gb=0.05, enable_prefix_caching=False, **engine) as llm:
        def run(n_out):
            params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(reqs, params, use_tqdm=False)
            return time.perf_counter() - start
        run(2)  # warm
        t_full = run(out_len)
        t_one = run(1)
        stats = llm.kv_cache_stats()
        waves = -(-prompts // (max(prompts, 1) if prompts <= 256 else 256))  # max_num_seqs above
        rec = {"elapsed_s": t_full, "output_tok_s": prompts * out_len / t_full,
               "decode_step_ms": 1e3 * (t_full - t_one) / max(out_len - 1, 1) / waves, "kv_blocks": stats["num_blocks"],
               "kv_block_bytes": stats["block_bytes"]}
        if batch1 is not None:
            reqs = reqs[:1]
            in1, out1 = batch1
            reqs = [{"prompt_token_ids": reqs[0]["prompt_token_ids"][:in1]}]
            run(2)
            t1_full, t1_one = run(out1), run(1)
            rec["batch1_ms_per_token"] = 1e3 * (t1_full - t1_one) / max(out1 - 1, 1)
    return rec


def _arch_of(path: str):
    from tokenmill.model.arch import model_arch
    from tokenmill.model.hf_config import load_hf_config
    return model_arch(load_hf_config(path))


def part_bench(results: dict, smoke: bool, device: str, big: bool = False) -> None:
    from tokenmill.benchmarks.roofline import kv_bytes_per_token
    bw = _bandwidth(device)
    results["copy_bandwidth_GBps"] = bw / 1e9
    sizes = [(256, 256, 128)] if not smoke else [(4, 8, 4)]
    if big and not smoke:
        sizes = [(1000, 512, 256)]
    for shape in ("olmoe-1b-7b", "qwen3-30b-a3b-24l"):
        path = config_dir(shape, smoke)
        arch = _arch_of(path)
        qwen = shape.startswith("qwen3")
        for n, i, o in sizes:
            rec = _engine_run(path, device, n, i, o, batch1=((8, 4) if smoke else (128, 128)) if qwen and not big else None)
            if "batch1_ms_per_token" in rec:
                _batch1_record(results, arch, rec.pop("batch1_ms_per_token"), bw)
            batch = min(n, 256)
            kv = batch * (i + o / 2) * kv_bytes_per_token(arch, "bfloat16")
            bound_ms = 1e3 * (_step_weight_bytes(arch, batch) + kv) / bw
            rec["decode_bound_ms"] = bound_ms
            rec["fraction_of_bound"] = bound_ms / rec["decode_step_ms"]
            rec["copy_bandwidth_GBps"] = bw / 1e9  # this part's own measurement (bench and big each measure)
            results[f"bench_{shape}_{n}x{i}x{o}"] = rec
            print(f"  {shape} {n}x{i}x{o}: {rec['output_tok_s']:.0f} output tok/s, decode step {rec['decode_step_ms']:.2f} ms"
                  f" vs bound {bound_ms:.2f} ms ({100 * rec['fraction_of_bound']:.0f}% of it; goal >= 60%)")


def _hf_baseline(results: dict, key: str, path: str, n: int, i: int, o: int, ours: float) -> None:
    """HF transformers' static-batch `generate` on n prompts x i in x o out (warmed on the same
    prompts with a short pass), next to tokenmill's output tok/s `ours` on the same work."""
    from tokenmill.benchmarks.hf_baseline import run_hf_generate
    from tokenmill.config import ModelConfig
    import random
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(i)] for _ in range(n)]
    mc = ModelConfig(path=path, name="hf", dtype="bfloat16", max_model_len=i + o + 16, load_format="dummy", seed=0,
                     eos_token_ids=(2,), arch=_arch_of(path))
    try:
        hf = run_hf_generate(mc, prompts, o, "bfloat16" if torch.cuda.is_available() else "float32",
                             ignore_eos=True, warmup_tokens=4)
    except Exception as exc:  # out of memory and such: say so, do not fail the script
        results[key] = {"error": str(exc)[:500]}
        print(f"  HF baseline failed: {exc}")
        return
    results[key] = {**hf, "ratio": ours / hf["output_tokens_per_s"]}
    print(f"  HF transformers (warmed) {key}: {hf['output_tokens_per_s']:.0f} output tok/s; tokenmill "
          f"{ours:.0f}, {ours / hf['output_tokens_per_s']:.1f}x (goal >= 5x)", flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def part_hf(results: dict, smoke: bool) -> None:
    """HF transformers on the bench's work for both shapes (run after `bench` and `big`, whose
    tokenmill figures it divides). 1000 x 512 x 256 does not fit one static batch (its cache alone
    is tens of GiB), and tokenmill runs it as four waves of 256 (max_num_seqs): HF runs the first
    256 prompts, one such wave, and its rate stands for the four."""
    for shape in ("olmoe-1b-7b", "qwen3-30b-a3b-24l"):
        path = config_dir(shape, smoke)
        for n, i, o in ([(4, 8, 4)] if smoke else [(256, 256, 128), (1000, 512, 256)]):
            rec = results.get(f"bench_{shape}_{n}x{i}x{o}")
            if rec is None:
                print(f"  {shape} {n}x{i}x{o}: no tokenmill figure in this run (run bench/big first); skipped")
                continue
            _hf_baseline(results, f"hf_{shape}_{n}x{i}x{o}", path, min(n, 256), i, o, rec["output_tok_s"])
            with open(os.path.join(OUT, "gpu_moe.json"), "w") as f:  # a run cut short keeps what it measured
                json.dump(results, f, indent=1, default=str)


def part_full(results: dict, smoke: bool, device: str) -> None:
    """The whole Qwen3-30B-A3B (48 layers; an H200): 256 x 256 x 128 with the bound, batch 1 against
    the floor, and HF transformers on the same work."""
    from tokenmill.benchmarks.roofline import kv_bytes_per_token
    shape = "qwen3-30b-a3b"
    bw = _bandwidth(device)
    path = config_dir(shape, smoke)
    arch = _arch_of(path)
    n, i, o = (4, 8, 4) if smoke else (256, 256, 128)
    rec = _engine_run(path, device, n, i, o, batch1=(8, 4) if smoke else (128, 128))
    ms1 = rec.pop("batch1_ms_per_token")
    floor_ms = 1e3 * _step_weight_bytes(arch, 1) / bw
    results[f"batch1_{shape}"] = dict(ms_per_token=ms1, floor_ms=floor_ms, fraction_of_floor=floor_ms / ms1)
    kv = n * (i + o / 2) * kv_bytes_per_token(arch, "bfloat16")
    bound_ms = 1e3 * (_step_weight_bytes(arch, n) + kv) / bw
    rec.update(decode_bound_ms=bound_ms, fraction_of_bound=bound_ms / rec["decode_step_ms"], copy_bandwidth_GBps=bw / 1e9)
    results[f"bench_{shape}_{n}x{i}x{o}"] = rec
    print(f"  {shape} (48 layers) {n}x{i}x{o}: {rec['output_tok_s']:.0f} output tok/s, decode step "
          f"{rec['decode_step_ms']:.2f} ms vs bound {bound_ms:.2f} ms ({100 * rec['fraction_of_bound']:.0f}%; goal >= 60%)")
    print(f"  batch 1: {ms1:.2f} ms/token vs floor {floor_ms:.2f} ms ({100 * floor_ms / ms1:.0f}%)", flush=True)
    with open(os.path.join(OUT, "gpu_moe.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    _hf_baseline(results, f"hf_{shape}_{n}x{i}x{o}", path, n, i, o, rec["output_tok_s"])


def _batch1_record(results: dict, arch, ms_per_token: float, bw: float) -> None:
    """Batch 1 reads the top-k experts of each MoE layer and every other weight once."""
    floor_ms = 1e3 * _step_weight_bytes(arch, 1) / bw
    rec = dict(ms_per_token=ms_per_token, floor_ms=floor_ms, fraction_of_floor=floor_ms / ms_per_token)
    results["batch1_qwen3-30b-a3b-24l"] = rec
    print(f"  Qwen3-30B-A3B shape (24 layers), batch 1: {ms_per_token:.2f} ms/token vs active-weight floor "
          f"{floor_ms:.2f} ms ({100 * rec['fraction_of_floor']:.0f}%)")


def part_mla(results: dict, smoke: bool, device: str) -> None:
    path = config_dir("deepseek-v2-lite", smoke)
    arch = _arch_of(path)
    n, i, o = (4, 8, 4) if smoke else (256, 256, 64)
    rec = _engine_run(path, device, n, i, o)
    m = arch.mla
    per_token_layer = rec["kv_block_bytes"] / (16 * arch.num_layers)
    dsize = 2 if device == "cuda" else 4
    check(per_token_layer == m.latent_dim * dsize,
          f"deepseek-v2-lite: KV bytes per token per layer {per_token_layer:.0f} = (kv_lora_rank + rope) x {dsize}")
    mha_per_token_layer = 2 * arch.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) * dsize
    rec["mha_kv_blocks_same_memory"] = int(rec["kv_blocks"] * per_token_layer / mha_per_token_layer)
    rec["more_sequences_factor"] = mha_per_token_layer / per_token_layer
    seq_blocks = -(-(i + o) // 16)
    rec["sequences_fit_latent"] = rec["kv_blocks"] // seq_blocks
    rec["sequences_fit_mha"] = rec["mha_kv_blocks_same_memory"] // seq_blocks
    kv = min(n, 256) * (i + o / 2) * arch.num_layers * per_token_layer
    rec["decode_bound_ms"] = 1e3 * (_step_weight_bytes(arch, min(n, 256)) + kv) / _bandwidth(device)
    rec["fraction_of_bound"] = rec["decode_bound_ms"] / rec["decode_step_ms"]
    results[f"mla_deepseek-v2-lite_{n}x{i}x{o}"] = rec
    print(f"  DeepSeek-V2-Lite batch {n}: decode step {rec['decode_step_ms']:.2f} ms (bound {rec['decode_bound_ms']:.2f} ms); "
          f"KV blocks {rec['kv_blocks']}: {rec['sequences_fit_latent']} sequences of {i + o} tokens fit; a plain MHA "
          f"cache in the same memory: {rec['mha_kv_blocks_same_memory']} blocks, {rec['sequences_fit_mha']} sequences "
          f"({rec['more_sequences_factor']:.1f}x fewer)")


def part_gptoss(results: dict, smoke: bool, device: str, dtype) -> None:
    _gptoss_kernel(results, smoke, device, dtype)
    _gptoss_parity(results, smoke, device)
    _gptoss_bench(results, smoke, device)


def _gptoss_kernel(results: dict, smoke: bool, device: str, dtype) -> None:
    from tokenmill.layers.moe.fused_moe import fused_experts
    from tokenmill.layers.moe.torch_experts import Activation, experts_reference
    e, h, i, k = SMOKE_KERNEL_SHAPES["tiny"] if smoke else GPT_OSS_KERNEL_SHAPE
    act = Activation("swiglu_clamped", 1.702, 7.0)
    for t in ((8,) if smoke else (256, 8)):
        x, w13, w2, weights, ids = _random_moe(e, h, i, k, t, dtype, device)
        x = x * 4  # gate/up projections of std ~3: some cross the clamp at 7
        gen = torch.Generator(device="cpu").manual_seed(1)
        b13 = torch.randn(e, 2 * i, generator=gen).to(dtype).to(device)
        b2 = (torch.randn(e, h, generator=gen) * 0.1).to(dtype).to(device)
        ref = experts_reference(x.float(), w13.float(), w2.float(), weights, ids, b13.float(), b2.float(), act)
        fused = lambda: fused_experts(x, w13, w2, weights, ids, b13=b13, b2=b2, act=act)  # noqa: E731
        out = fused()
        err = float((out.float() - ref).abs().max() / ref.abs().max())
        check(err < (2e-2 if dtype == torch.bfloat16 else 1e-3),
              f"gpt-oss experts T={t}: fused (biases, clamped SwiGLU) vs loop relative error {err:.2e}")
        reps = 1 if smoke else 20
        t_fused = timed(fused, reps, device)
        t_loop = timed(lambda: experts_reference(x, w13, w2, weights, ids, b13, b2, act), reps, device)
        rec = {"fused_ms": t_fused * 1e3, "loop_ms": t_loop * 1e3, "speedup": t_loop / t_fused, "rel_err": err}
        results[f"gptoss_kernel_T{t}"] = rec
        print(f"  gpt-oss-20b experts T={t}: fused {rec['fused_ms']:.3f} ms, per-expert loop {rec['loop_ms']:.3f} ms, "
              f"{rec['speedup']:.1f}x")
        if device == "cuda" and t == 8:
            graph = torch.cuda.CUDAGraph()
            static_out = fused()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                static_out = fused()
            ids.copy_(ids.roll(1, dims=0))
            graph.replay()
            torch.cuda.synchronize()
            check(torch.equal(static_out, fused()), "gpt-oss experts: the fused MoE replays in a CUDA graph")


def _gptoss_parity(results: dict, smoke: bool, device: str) -> None:
    """Tiny gpt-oss, float32, CUDA graphs on (the default), against HF on CPU: the float checkpoint,
    and its MXFP4 form (HF reads the float twin of exactly the values MXFP4 decodes to)."""
    from transformers import AutoModelForCausalLM
    from tests.helpers.moe_reference import check_against_hf, generate, prompts_for
    from tests.helpers.mxfp4 import dequantized_twin, mxfp4_checkpoint
    from tests.helpers.tiny_moe_models import make_tiny_moe_model_dir
    from tokenmill import LLM
    root = tempfile.mkdtemp(prefix="gptoss-parity-")
    path = make_tiny_moe_model_dir("gpt_oss", root)
    mx = mxfp4_checkpoint(path, os.path.join(root, "mxfp4"))
    cases = {"gpt_oss": (path, path), "gpt_oss_mxfp4": (mx, dequantized_twin(mx, os.path.join(root, "twin")))}
    prompts = prompts_for("gpt_oss")
    for label, (ours, reference) in cases.items():
        hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
        try:
            with LLM(ours, dtype="float32", device=device, max_model_len=128, gpu_memory_utilization=0.3,
                     kv_cache_memory_gb=0.01, max_num_batched_tokens=32, max_num_seqs=4) as llm:
                outs = generate(llm, prompts, 0)
            check_against_hf(hf, prompts, outs, label)
            mode = "graphs" if device == "cuda" else "eager"
            check(True, f"{label}: float32 on {device} ({mode}) = HF (tokens, prompt and sampled logprobs within 1e-4)")
            results[f"parity_{label}"] = "ok"
        except AssertionError as exc:
            check(False, f"{label}: {str(exc)[:300]}")
            results[f"parity_{label}"] = str(exc)[:2000]


def _gptoss_bench(results: dict, smoke: bool, device: str) -> None:
    from tokenmill.benchmarks.roofline import kv_bytes_per_token
    bw = _bandwidth(device)
    results.setdefault("copy_bandwidth_GBps", bw / 1e9)
    path = config_dir("gpt-oss-20b", smoke)
    arch = _arch_of(path)
    n, i, o = (4, 8, 4) if smoke else (256, 256, 128)
    rec = _engine_run(path, device, n, i, o)
    # KV a decode step reads: full layers their whole context, sliding ones at most their window.
    per_layer = kv_bytes_per_token(arch, "bfloat16") / arch.num_layers
    ctx = i + o / 2
    keys = sum(min(ctx, arch.layer_spec(j).sliding_window or ctx) for j in range(arch.num_layers))
    kv = n * keys * per_layer
    bound_ms = 1e3 * (_step_weight_bytes(arch, n) + kv) / bw
    rec["decode_bound_ms"] = bound_ms
    rec["fraction_of_bound"] = bound_ms / rec["decode_step_ms"]
    results[f"bench_gpt-oss-20b_{n}x{i}x{o}"] = rec
    print(f"  gpt-oss-20b shape {n}x{i}x{o}: {rec['output_tok_s']:.0f} output tok/s, decode step "
          f"{rec['decode_step_ms']:.2f} ms vs bound {bound_ms:.2f} ms ({100 * rec['fraction_of_bound']:.0f}% of it)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="kernel,tune,parity,bench,mla")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    os.makedirs(OUT, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "smoke": args.smoke}
    parts = args.parts.split(",")
    for part in parts:
        start = time.perf_counter()
        print(f"== {part}")
        if part == "kernel":
            part_kernel(results, args.smoke, device, dtype)
        elif part == "tune":
            part_tune(results, args.smoke, device, dtype)
        elif part == "parity":
            part_parity(results, args.smoke, device)
        elif part == "bench":
            part_bench(results, args.smoke, device)
        elif part == "big":
            part_bench(results, args.smoke, device, big=True)
        elif part == "full":
            part_full(results, args.smoke, device)
        elif part == "hf":
            part_hf(results, args.smoke)
        elif part == "mla":
            part_mla(results, args.smoke, device)
        elif part == "profile":
            from gpu_moe_profile import part_profile
            part_profile(results, args.smoke, device, config_dir, OUT, _arch_of, _step_weight_bytes, _bandwidth(device))
        elif part == "sweep":
            from gpu_moe_profile import part_sweep
            part_sweep(results, args.smoke, device, dtype, _random_moe, OUT)
        elif part == "gptoss":
            part_gptoss(results, args.smoke, device, dtype)
        else:
            raise SystemExit(f"unknown part {part!r}")
        print(f"[{part}: {time.perf_counter() - start:.0f} s]")
        with open(os.path.join(OUT, "gpu_moe.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in results.items() if not k.startswith(("tune", "profile", "sweep"))}, indent=1,
                     default=str)[:6000])
    if FAILURES:
        print(f"{len(FAILURES)} failed checks:\n" + "\n".join(FAILURES))
        sys.exit(1)


if __name__ == "__main__":
    main()
