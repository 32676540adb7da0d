"""Quantized serving on a GPU: kernel checks against the torch references, then FP8 W8A8, INT4 W4A16
and the FP8 KV cache timed against bf16 tokenmill in the same run (Llama-3.1-8B shape, dummy
weights, CUDA graphs on). Prints a table, writes $OUT/gpu_quant.json (default ./gpu-out), exits
non-zero when a check fails.

Parts (--parts, comma-separated; default all):
  kernels  CUDA kernels vs references: int4 dequantize-GEMM (groups, act-order, split-K, bf16),
           block fp8 GEMM, per-token(-group) fp8 activation quantization, the _scaled_mm path,
           fp8 KV write rounding and paged attention over fp8 blocks (both fp8 formats)
  tiny     tiny quantized checkpoints of every format (tests/helpers/quant_formats.py) on CUDA
           (Triton, graphs): prompt logprobs vs the same checkpoint on the CPU engine (float32)
  bf16     the baseline engine: 256x256x128, 1000x512x256, batch 1 (512 in), batch 1 with a
           16k-token prompt; KV blocks
  fp8      FP8 W8A8 (online, per-channel weights): 256x256x128, 1000x512x256, batch 1
  int4     INT4 W4A16 (a GPTQ config, group 128; dummy weights quantized at load): batch 1, 256x256x128
  kvfp8    bf16 weights, fp8 (e4m3) KV cache: KV blocks, 1000x512x256, batch 1 with a 16k prompt
Goals (issue 22): fp8 >= 1.5x bf16 tok/s and <= 0.6x ms/token at batch 1; int4 batch 1 <= 0.4x,
batch 256 >= 1.0x; fp8 KV 2x blocks, >= 1.0x tok/s, 16k decode ms/token <= bf16's.

    python scripts/gpu_quant.py                      # everything (< 8 minutes on an H100)
    python scripts/gpu_quant.py --parts kernels,tiny # checks only
    python scripts/gpu_quant.py --smoke              # CPU: tiny shapes, a few tokens (no timings)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
import traceback

import torch

# Test modules imported below set TRITON_INTERPRET=1 for CPU runs; on a GPU the kernels must compile.
if torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "0"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.helpers.tiny_models import make_tiny_model_dir, make_tiny_tokenizer  # noqa: E402

OUT = os.environ.get("OUT", "./gpu-out")
LLAMA8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
               tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=1,
               eos_token_id=2, pad_token_id=2)
SMOKE = dict(LLAMA8B, vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
               "checkpoint_format": "gptq"}
FAILURES: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
        FAILURES.append(what)


def config_dir(shape: dict, quantization_config: dict | None = None) -> str:
    from transformers import LlamaConfig
    path = tempfile.mkdtemp(prefix="quant-config-")
    config = LlamaConfig(**shape)
    config.architectures = ["LlamaForCausalLM"]
    if quantization_config is not None:
        config.quantization_config = quantization_config
    config.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


# ---------------------------------------------------------------- kernel checks

def kernels(results: dict, device: str) -> None:
    from tokenmill.layers.attention.backend import quantize_kv
    from tokenmill.layers.quantization import fp8_ops
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization.triton_fp8 import block_fp8_gemm, quantize_row_groups
    from tokenmill.layers.quantization.triton_int4 import int4_gemm

    g = torch.Generator().manual_seed(0)
    rec = results.setdefault("kernels", {})
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    for n, k, group, act_order in ((512, 1024, 128, False), (384, 512, -1, False), (256, 512, 64, True)):
        w = torch.randn(n, k, generator=g) * 0.05
        perm = torch.randperm(k, generator=g) if act_order else None
        codes = packing.quantize_int4(w, group, sym=False, perm=perm)
        wt = packing.from_codes(codes, dt, act_order)
        wt = packing.Int4Weights(*(t.to(device) if t is not None else None for t in
                                   (wt.qweight, wt.scales, wt.zeros, wt.g_idx)))
        ref_w = packing.dequantize(wt, group, torch.float32)
        for m in (1, 7, 64, 300):
            x = torch.randn(m, k, generator=g).to(device, dt)
            out = int4_gemm(x, wt.qweight, wt.scales, wt.zeros, wt.g_idx, group).float()
            ref = x.float() @ ref_w
            err = ((out - ref).norm() / ref.norm()).item()
            rec[f"int4_{n}x{k}_g{group}{'_act' if act_order else ''}_m{m}"] = err
            check(err < 1e-2, f"int4 GEMM {m}x{k}x{n} group {group}{' act-order' if act_order else ''}: rel err {err:.1e}")
    if device != "cuda":
        return
    fp8 = torch.float8_e4m3fn
    x = torch.randn(33, 512, generator=g).to(device, dt) * 4
    for group in (128, 512):
        q, s = quantize_row_groups(x, group)
        rq, rs = fp8_ops.quantize_row_groups(x, group)
        mism = (q.float() != rq.float()).float().mean().item()
        check(torch.allclose(s, rs, rtol=1e-6) and mism < 1e-3, f"fp8 activation quantization, groups of {group}: "
                                                                 f"{mism:.1e} codes differ")
    w = torch.randn(384, 512, generator=g).to(device) * 0.05
    wq, ws = fp8_ops.quantize_blocks(w, (128, 128))
    for m in (1, 16, 200):
        xm = torch.randn(m, 512, generator=g).to(device, dt)
        xq, xs = quantize_row_groups(xm, 128)
        out = block_fp8_gemm(xq, xs, wq, ws, (128, 128), dt).float()
        ref = fp8_ops.block_mm_reference(xq, xs, wq, ws, (128, 128), torch.float32)
        err = ((out - ref).norm() / ref.norm()).item()
        check(err < 1e-2, f"block fp8 GEMM m={m}: rel err {err:.1e}")
    wq_c, ws_c = fp8_ops.quantize_rows(w)
    xq, xs = quantize_row_groups(x, 512)
    out = torch._scaled_mm(xq, wq_c.t(), scale_a=xs, scale_b=ws_c.reshape(1, -1).contiguous(), out_dtype=dt)
    ref = fp8_ops.scaled_mm_reference(xq, xs, wq_c, ws_c, torch.float32)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    check(err < 1e-2, f"_scaled_mm row-wise: rel err {err:.1e}")
    # FP8 KV cache: the Triton write rounds like torch; attention over fp8 blocks = the torch reference's.
    from tests.layers.test_fp8_kv_cache import _fp8_case
    from tokenmill.layers.attention import triton_kv_write
    from tokenmill.layers.attention.triton_backend import TritonAttentionBackend
    for kv_dtype in (fp8, torch.float8_e5m2):
        case, cache8, expected = _fp8_case(kv_dtype, 0.5, 2.0)
        cache = cache8.to(device)
        k_new = case.k.to(device, dt)
        triton_kv_write.write_kv(k_new, case.v.to(device, dt), cache, case.meta.slot_mapping.to(device), 0.5, 2.0)
        slots = case.meta.slot_mapping
        real = (slots >= 0).to(device)
        flat = cache.view(2, -1, *cache.shape[3:])
        want = quantize_kv(k_new[real], 0.5, kv_dtype).float()
        got = flat[0, slots.to(device)[real]].float()
        check(torch.equal(got, want), f"fp8 KV write ({kv_dtype}): codes equal torch's rounding")
        backend = TritonAttentionBackend(4, 2, 32, 1 / math.sqrt(32))
        backend.k_scale, backend.v_scale = 0.5, 2.0
        meta = case.meta
        dev_meta = type(meta)(**{f: (getattr(meta, f).to(device) if isinstance(getattr(meta, f), torch.Tensor)
                                     and not f.endswith("_cpu") else getattr(meta, f))
                                 for f in meta.__dataclass_fields__})
        out = backend.forward(case.q.to(device), case.k_rt.to(device), case.v_rt.to(device), cache8.to(device), dev_meta)
        n = meta.num_tokens
        err = (out[:n].float().cpu() - expected[:n]).abs().max().item()
        check(err < 2e-3, f"paged attention over {kv_dtype} blocks: max err {err:.1e}")


# ---------------------------------------------------------------- tiny checkpoints of every format

def tiny(results: dict, device: str) -> None:
    from tests.helpers.quant_formats import write_quantized_model
    from tokenmill import LLM, SamplingParams

    root = tempfile.mkdtemp(prefix="quant-tiny-")
    float_dir = make_tiny_model_dir("llama", root, hidden_size=128, intermediate_size=256,
                                    num_attention_heads=4, num_key_value_heads=2)
    prompt = [(i * 37 + 11) % 250 + 3 for i in range(40)]
    cases = [("fp8-channel", {}), ("fbgemm", {}), ("fp8-block", {"block": (32, 32)}),
             ("gptq", {"group_size": 32, "sym": False, "desc_act": True}), ("awq", {"group_size": 32})]
    try:
        import compressed_tensors  # noqa: F401
        cases.append(("ct-int4", {"group_size": 32, "sym": True}))
    except ImportError:
        print("  (compressed-tensors not installed: ct-int4 skipped)")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for fmt, opts in cases:
        path, _ = write_quantized_model(float_dir, os.path.join(root, fmt), fmt, with_refs=False, **opts)
        lps = {}
        for dev in ("cpu", device):
            llm = LLM(path, dtype="float32" if dev == "cpu" else "bfloat16", device=dev, single_process=True,
                      kv_cache_memory_gb=0.01, num_gpu_blocks_override=64 if dev != "cpu" else None,
                      max_model_len=128, max_num_seqs=4)
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            lps[dev] = torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])])
            del llm
        err = (lps["cpu"] - lps[device]).abs().max().item()
        results.setdefault("tiny", {})[fmt] = err
        check(err < 0.1, f"{fmt}: {device} bf16 vs CPU float32 prompt logprobs, max diff {err:.3f}")


# ---------------------------------------------------------------- timings

def _engine(path: str, max_model_len: int, **kwargs):
    from tokenmill import LLM
    start = time.perf_counter()
    llm = LLM(path, load_format="dummy", dtype="bfloat16", max_model_len=max_model_len, disable_log_stats=True,
              **kwargs)
    print(f"  engine {kwargs or 'bf16'} up in {time.perf_counter() - start:.0f} s; "
          f"{llm.kv_cache_stats()['num_blocks']} KV blocks")
    return llm


def _prompts(num: int, length: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 259) for _ in range(length)]} for _ in range(num)]


def throughput(llm, num: int, input_len: int, output_len: int) -> float:
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    llm.generate(_prompts(min(num, 16), input_len, seed=1), params, use_tqdm=False)  # warm
    start = time.perf_counter()
    outs = llm.generate(_prompts(num, input_len), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def ms_per_token(llm, input_len: int, output_len: int) -> float:
    """Decode time per output token at batch 1: (time for 1 + N tokens - time for 1 token) / N."""
    from tokenmill import SamplingParams

    def timed(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        llm.generate(_prompts(1, input_len, seed=2), params, use_tqdm=False)
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            llm.generate(_prompts(1, input_len, seed=3), params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        return best
    return 1000 * (timed(1 + output_len) - timed(1)) / output_len


def timings(results: dict, parts: set[str], smoke: bool) -> None:
    shape = SMOKE if smoke else LLAMA8B
    scale = (lambda n: max(1, n // 64)) if smoke else (lambda n: n)
    long_ctx = 1024 if smoke else 16384
    max_len = long_ctx + 256 + 16
    plain = config_dir(shape)
    t = results.setdefault("timings", {})
    kw = dict(device="cpu", enforce_eager=True, kv_cache_memory_gb=0.05) if smoke else {}

    def run(label: str, llm, workloads: list[str]) -> None:
        rec = t.setdefault(label, {"kv_blocks": llm.kv_cache_stats()["num_blocks"]})
        for w in workloads:
            if w == "256x256x128":
                rec[w] = throughput(llm, scale(256), scale(256), scale(128))
            elif w == "1000x512x256":
                rec[w] = throughput(llm, scale(1000), scale(512), scale(256))
            elif w == "batch1":
                rec[w] = ms_per_token(llm, scale(512), scale(256) if not smoke else 4)
            elif w == "batch1_16k":
                rec[w] = ms_per_token(llm, long_ctx, 64 if not smoke else 4)
            print(f"  {label} {w}: {rec[w]:.2f} {'ms/token' if w.startswith('batch1') else 'output tok/s'}")

    if "bf16" in parts:
        llm = _engine(plain, max_len, **kw)
        run("bf16", llm, ["256x256x128", "1000x512x256", "batch1", "batch1_16k"])
        llm.shutdown() if hasattr(llm, "shutdown") else None
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if "fp8" in parts:
        llm = _engine(plain, max_len, quantization="fp8", **kw)
        run("fp8", llm, ["256x256x128", "1000x512x256", "batch1"])
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if "int4" in parts:
        llm = _engine(config_dir(shape, GPTQ_CONFIG), max_len, **kw)
        run("int4", llm, ["batch1", "256x256x128"])
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if "kvfp8" in parts:
        llm = _engine(plain, max_len, kv_cache_dtype="fp8", **kw)
        run("kvfp8", llm, ["1000x512x256", "batch1_16k"])
        del llm
    base = t.get("bf16")
    if base is None or smoke:
        return
    ratios = results.setdefault("ratios", {})

    def ratio(label: str, w: str, goal: float, higher_is_better: bool) -> None:
        if label in t and w in t[label]:
            r = t[label][w] / base[w]
            ratios[f"{label}/{w}"] = r
            ok = r >= goal if higher_is_better else r <= goal
            print(f"  {'meets' if ok else 'MISSES'} goal: {label} {w} = {r:.2f}x bf16 (goal {'>=' if higher_is_better else '<='} {goal})")
    ratio("fp8", "256x256x128", 1.5, True)
    ratio("fp8", "1000x512x256", 1.5, True)
    ratio("fp8", "batch1", 0.6, False)
    ratio("int4", "batch1", 0.4, False)
    ratio("int4", "256x256x128", 1.0, True)
    ratio("kvfp8", "kv_blocks", 1.99, True)
    ratio("kvfp8", "1000x512x256", 1.0, True)
    ratio("kvfp8", "batch1_16k", 1.0, False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="kernels,tiny,bf16,fp8,int4,kvfp8")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks that the script runs")
    ns = ap.parse_args()
    parts = set(ns.parts.split(","))
    device = "cpu" if ns.smoke or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not ns.smoke:
        print("no CUDA device: use --smoke on a CPU")
        return 2
    os.makedirs(OUT, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "torch": torch.__version__, "parts": sorted(parts)}
    start = time.perf_counter()
    for name, fn in (("kernels", lambda: kernels(results, device)), ("tiny", lambda: tiny(results, device))):
        if name in parts and not (ns.smoke and name == "tiny"):
            print(f"== {name}")
            try:
                fn()
            except Exception:
                traceback.print_exc()
                FAILURES.append(f"{name} raised")
    if parts & {"bf16", "fp8", "int4", "kvfp8"}:
        print("== timings (Llama-3.1-8B shape, dummy weights, graphs on)" if not ns.smoke else "== timings (smoke)")
        try:
            timings(results, parts, ns.smoke)
        except Exception:
            traceback.print_exc()
            FAILURES.append("timings raised")
    results["failures"] = FAILURES
    results["seconds"] = time.perf_counter() - start
    with open(os.path.join(OUT, "gpu_quant.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps({k: v for k, v in results.items() if k in ("timings", "ratios", "failures")}, indent=2))
    print(f"done in {results['seconds']:.0f} s; {len(FAILURES)} failed checks")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
