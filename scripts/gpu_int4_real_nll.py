"""INT4 on the real SmolLM2-135M on a GPU: is the decode path (norms and adds folded into the INT4
GEMVs, `quantization.int4_norm_fold`, the default) as good as the unfolded one on real weights?

The benchmarks time INT4 with dummy weights, where near ties make greedy tokens part early; this
checks the numerics on the one real model this project has. From the GGUF: a float32 checkpoint,
then an INT4 checkpoint in GPTQ's format (group 64: 128 does not divide SmolLM2's 576 inputs;
symmetric; rounded to nearest, or with --quantizer gptq by GPTQ calibrated on another text,
minutes on a CPU). On this project's CPU (float32 activations) the round-to-nearest checkpoint
gives NLL 3.8105 against float32's 3.4947 (+9.0%), chunks of 32. Engines: float32, bf16, INT4
with the fold, INT4 with TOKENMILL_INT4_NORM_FOLD=0. Each
gives the mean negative log-likelihood of a few hundred tokens of English text, the prompt fed in
chunks of --chunk tokens (8: every step small enough to run folded), and greedy tokens of a chat
prompt. Prints a table and writes a JSON record.

    python scripts/gpu_int4_real_nll.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers (GPTQ, the texts)

ENGINES = {  # name -> (checkpoint, dtype, environment)
    "float32": ("float", "float32", {}),
    "bf16": ("float", "bfloat16", {}),
    "int4_fold": ("gptq", "bfloat16", {"TOKENMILL_INT4_NORM_FOLD": "1"}),
    "int4_nofold": ("gptq", "bfloat16", {"TOKENMILL_INT4_NORM_FOLD": "0"}),
}
# The fold adds in split-K epilogues, so every folded GEMV needs a split: SmolLM2's K = 576 linears
# (9 groups of 64) get split 3 in both INT4 engines (the default launch leaves them unsplit).
INT4_TABLE = {"TOKENMILL_INT4_MMA_TABLE": "960x576=mma w4 s3 g1;576x576=mma w4 s3 g1;3072x576=mma w4 s3 g1"}
CHAT = "What is the capital of France? Answer in one sentence, then name two famous buildings there."


def float_checkpoint(gguf: str, out: Path) -> str:
    from safetensors.torch import save_file

    from tokenmill.model.arch import model_arch
    from tokenmill.model.gguf_loader import GGUFWeights
    from tokenmill.model.hf_config import load_hf_config
    from tokenmill.model.tokenizer import load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = load_hf_config(gguf)
    tensors = {name: t.float().contiguous() for name, t in GGUFWeights(gguf, model_arch(config))}
    save_file(tensors, str(out / "model.safetensors"))
    config.save_pretrained(out)
    load_tokenizer(gguf).save_pretrained(out)
    return str(out)


def folded_layers(llm) -> int:
    """How many decoder layers ran folded (`LlamaDecoderLayer._int4_fold`), in a single-process engine."""
    from tests.helpers.engine import worker_runner

    model = worker_runner(llm).model
    return sum(1 for m in model.modules() if getattr(m, "_int4_fold", None) is True)


def run_engine(name: str, path: str, ids: list[int], chat_ids: list[int], chunk: int, tokens: int) -> dict:
    from tokenmill import LLM, SamplingParams

    _, dtype, env = ENGINES[name]
    for key in ("TOKENMILL_INT4_NORM_FOLD", *INT4_TABLE):
        os.environ.pop(key, None)
    os.environ.update(env)
    if name.startswith("int4"):
        os.environ.update(INT4_TABLE)
    start = time.perf_counter()
    llm = LLM(path, dtype=dtype, max_model_len=1024, kv_cache_memory_gb=0.5, single_process=True,
              max_num_batched_tokens=chunk, disable_log_stats=True)
    try:
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        nll = -sum(lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:])) / (len(ids) - 1)
        gen = llm.generate([{"prompt_token_ids": chat_ids}], SamplingParams(temperature=0, max_tokens=tokens),
                           use_tqdm=False)[0].outputs[0]
        folded = folded_layers(llm)
    finally:
        llm.shutdown()
    record = {"engine": name, "dtype": dtype, "env": env, "nll": nll, "folded_layers": folded,
              "tokens": list(gen.token_ids), "text": gen.text, "seconds": round(time.perf_counter() - start, 1)}
    print(f"  {name:12s} NLL {nll:.4f}  folded layers {folded}  ({record['seconds']} s): {gen.text[:80]!r}", flush=True)
    return record


def agreement(a: list[int], b: list[int]) -> int:
    """Greedy tokens equal before the first difference."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", default="int4-real-nll.json")
    ap.add_argument("--chunk", type=int, default=8, help="prompt tokens a step (<= 8: the fold's rows)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens of the chat prompt")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--quantizer", choices=("rtn", "gptq"), default="rtn",
                    help="round to nearest (fast), or GPTQ calibrated on another text (minutes on a CPU)")
    ap.add_argument("--group", type=int, default=64, help="GPTQ group size (SmolLM2's 576 inputs: 32, 64, 192, 576)")
    args = ap.parse_args()

    import torch

    from tests.engine.test_quantized_smollm2 import CALIBRATION, TEXT
    from tests.helpers.gptq import gptq_checkpoint
    from tests.helpers.quant_formats import write_quantized_model
    from tokenmill.model.tokenizer import load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="int4-real-"))
    print(f"[1/3] float32 checkpoint from {args.gguf}", flush=True)
    paths = {"float": float_checkpoint(args.gguf, work / "float")}
    tok = load_tokenizer(paths["float"])
    print(f"[2/3] INT4 checkpoint ({args.quantizer}): GPTQ format, group {args.group}, symmetric", flush=True)
    t0 = time.perf_counter()
    if args.quantizer == "gptq":  # (slow: column by column on the CPU)
        paths["gptq"] = gptq_checkpoint(paths["float"], work / "gptq", tok(CALIBRATION).input_ids,
                                        group_size=args.group, sym=True, act_order=False)
    else:
        paths["gptq"], _ = write_quantized_model(paths["float"], work / "gptq", "gptq", with_refs=False,
                                                 group_size=args.group, sym=True)
    print(f"      {time.perf_counter() - t0:.0f} s", flush=True)
    ids = tok(TEXT).input_ids
    chat = tok.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True, tokenize=False)
    chat_ids = tok(chat, add_special_tokens=False).input_ids
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"[3/3] engines on {device}: {len(ids)} text tokens in chunks of {args.chunk}",
          flush=True)
    runs = {name: run_engine(name, paths[ENGINES[name][0]], ids, list(chat_ids), args.chunk, args.tokens)
            for name in args.engines.split(",")}
    ref = runs.get("float32")
    summary = {}
    for name, r in runs.items():
        if ref is not None:
            r["nll_vs_float32"] = r["nll"] / ref["nll"] - 1
            r["greedy_agree_float32"] = agreement(r["tokens"], ref["tokens"])
        summary[name] = {k: r.get(k) for k in ("nll", "nll_vs_float32", "folded_layers", "greedy_agree_float32")}
    if "int4_fold" in runs and "int4_nofold" in runs:
        a, b = runs["int4_fold"], runs["int4_nofold"]
        summary["fold_vs_nofold"] = {"nll_ratio": a["nll"] / b["nll"] - 1,
                                     "greedy_agree": agreement(a["tokens"], b["tokens"]), "tokens": args.tokens}
    print(json.dumps(summary, indent=1), flush=True)
    Path(args.out).write_text(json.dumps({"device": device, "torch": torch.__version__,
                                          "chunk": args.chunk, "text_tokens": len(ids), "summary": summary,
                                          "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
