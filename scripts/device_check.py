"""One-shot CUDA check, run on a lent GPU: greedy parity with HF at SmolLM2-135M's shape, and timings.

The real SmolLM2 GGUF (98 MB) cannot travel to the device machine, so this uses
random weights of exactly its config, saved as a HF directory and loaded by both
HF transformers and tokenmill. Prints a table and writes $OUT/device_check.json.

    python scripts/device_check.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers.hf_reference import compare_greedy, hf_greedy  # noqa: E402
from tests.helpers.tiny_models import make_tiny_tokenizer  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
               rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0,
               bos_token_id=1, eos_token_id=2, pad_token_id=2)
LENGTHS = [5, 8, 13, 21, 34, 55, 89, 120, 160, 210, 270, 330, 400, 470, 540, 600]


def make_model_dir() -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(**SMOLLM2)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than HF's init so logits are peaked, like a trained model's
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.06)
    path = tempfile.mkdtemp(prefix="smollm2-shape-")
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def parity(path: str, dtype: str, results: dict, **engine_kwargs) -> None:
    from transformers import AutoModelForCausalLM

    from tokenmill import LLM, SamplingParams
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in LENGTHS]
    llm = LLM(path, dtype=dtype, gpu_memory_utilization=0.4, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    exact = near_tie = mismatch = 0
    notes = []
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(hf, prompt, 64)
        try:
            note = compare_greedy(out.outputs[0].token_ids, ref, f"len {len(prompt)}")
        except AssertionError as exc:
            mismatch += 1
            notes.append(str(exc).splitlines()[0])
            continue
        if note:
            near_tie += 1
            notes.append(note)
        else:
            exact += 1
    stats = llm.kv_cache_stats()
    llm.shutdown()
    key = f"parity_{dtype}_" + "_".join(f"{k}={v}" for k, v in engine_kwargs.items())
    results[key] = {"exact": exact, "near_tie": near_tie, "mismatch": mismatch, "notes": notes,
                    "kv_free_after": stats["num_free_blocks"] == stats["num_blocks"]}
    print(f"{key}: exact {exact}/16, near-tie {near_tie}, mismatch {mismatch}")
    for n in notes:
        print("   ", n)


def throughput(path: str, batch: int, results: dict, **engine_kwargs) -> None:
    from tokenmill import LLM, SamplingParams
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(128)]} for _ in range(batch)]
    llm = LLM(path, dtype="bfloat16", load_format="dummy", **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    key = f"throughput_b{batch}_" + "_".join(f"{k}={v}" for k, v in engine_kwargs.items())
    results[key] = {"elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed}
    print(f"{key}: {tokens / elapsed:.0f} output tok/s ({elapsed:.2f} s)")


def device_idle(path: str, batch: int, results: dict) -> None:
    """SmolLM2-shape dummy weights: device idle between steps and tokens/s, async scheduling off vs on."""
    from tokenmill import LLM, SamplingParams
    prompts = [{"prompt_token_ids": [10 + (i * 7) % 40000 for i in range(j, j + 32)]} for j in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True, detokenize=False)
    for async_on in (False, True):
        with LLM(path, load_format="dummy", dtype="bfloat16", async_scheduling=async_on,
                 max_model_len=1024, gpu_memory_utilization=0.4) as llm:
            llm.generate(prompts[:4], SamplingParams(max_tokens=8, detokenize=False), use_tqdm=False)
            llm.reset_telemetry()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            report = llm.telemetry()
        worker = next(p for p in report.processes if p.role == "worker0")
        idle = worker.timings.get("device_idle")
        fwd = worker.timings.get("forward")
        key = f"idle_b{batch}_async_{'on' if async_on else 'off'}"
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        results[key] = {"device_idle_us_mean": idle.mean_us if idle else None,
                        "device_idle_us_p50": idle.p50_us if idle else None,
                        "device_idle_us_p99": idle.p99_us if idle else None,
                        "forward_host_us_mean": fwd.mean_us if fwd else None,
                        "output_tokens_per_s": tokens / elapsed}
        print(f"{key}: idle mean {results[key]['device_idle_us_mean']:.0f} us p50 "
              f"{results[key]['device_idle_us_p50']:.0f} us p99 {results[key]['device_idle_us_p99']:.0f} us; "
              f"{tokens / elapsed:.0f} tok/s")


def tiny_families(results: dict, archs) -> None:
    """Every supported family (tiny random configs, GQA, tied and untied) vs HF on the GPU."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.tiny_models import make_tiny_model_dir
    from tokenmill import LLM, SamplingParams
    rng = random.Random(0)
    for arch in archs:
        for tied in (False, True):
            path = make_tiny_model_dir(arch, tempfile.mkdtemp(), tie_word_embeddings=tied)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
            prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in (1, 7, 33, 100)]
            for dtype in ("float32", "bfloat16", "float16"):
                llm = LLM(path, dtype=dtype, gpu_memory_utilization=0.2, max_num_batched_tokens=64)
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
                llm.shutdown()
                ok = 0
                for prompt, out in zip(prompts, outs):
                    try:
                        compare_greedy(out.outputs[0].token_ids, hf_greedy(hf, prompt, 24))
                        ok += 1
                    except AssertionError:
                        pass
                key = f"tiny_{arch}_{'tied' if tied else 'untied'}_{dtype}"
                results[key] = ok
                print(f"{key}: {ok}/4 match HF float32 greedy")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="tiny,parity,idle,throughput")
    ap.add_argument("--archs", default="llama,llama3,mistral,qwen2,qwen3")
    args = ap.parse_args()
    parts = args.parts.split(",")
    results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if "tiny" in parts:
        tiny_families(results, args.archs.split(","))
    path = make_model_dir()
    if "parity" in parts:
        parity(path, "float32", results)
        parity(path, "float32", results, max_num_batched_tokens=256)
        parity(path, "bfloat16", results)
    if "idle" in parts:
        for batch in (64, 256):
            device_idle(path, batch, results)
    if "throughput" in parts:
        for batch in (64, 256):
            throughput(path, batch, results)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "device_check.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
