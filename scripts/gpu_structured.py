"""Structured outputs on the device: throughput with every request constrained vs none, same run.

    python scripts/gpu_structured.py            # H100: Llama-3.1-8B shape, dummy bf16 weights, 256 requests
    python scripts/gpu_structured.py --smoke    # CPU: a tiny shape, 4 requests (checks the script)

The model has a synthetic 128,256-token vocabulary (a word-level tokenizer over random strings of
letters, digits, punctuation and JSON characters), so XGrammar's masks cover a real vocabulary's
width. Every constrained request follows a JSON schema whose only string has minLength 100000:
all its tokens are generated inside that string, where almost any token is allowed, so each step's
mask is real work. Both runs use ignore_eos and the same max_tokens, so they generate the same
number of tokens. From the step trace: the core's mask time per constrained row (token), and how
many steps the device waited for a mask (the worker's `await_mask` spans whose forward pass had
already finished when the mask arrived). Writes $OUT/gpu_structured.json; exits 1 when the
constrained run produced an invalid prefix or finished early, or (full mode) the ratio is < 0.95.

Then speculative decoding with constraints, on the device's own paths (verification graphs on
CUDA): a tiny random model (byte tokens, float32), regex-constrained greedy requests whose
prompts repeat themselves, with n-gram drafts and with the model as its own draft, must give the
tokens of the same engine without speculation, with drafts accepted, rejected and forbidden by
the grammar (tests/engine/test_structured_speculation.py's check, on CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SHAPES = {
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                    tie_word_embeddings=False, rope_theta=500000.0),
    "tiny": dict(vocab_size=128256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 tie_word_embeddings=True, rope_theta=10000.0),
}
SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 100000}}, "required": ["text"]}
_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?-_'\"{}[]()/\\"


def model_dir(shape: str, vocab: int) -> str:
    """config.json of `shape` and a word-level tokenizer of `vocab` random strings (ids 0-2 special)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast
    rng = random.Random(0)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    while len(words) < vocab:
        words.setdefault("".join(rng.choice(_CHARS) for _ in range(rng.randint(1, 8))), len(words))
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tempfile.mkdtemp(prefix=f"{shape}-structured-")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    return path


def trace_figures(path: str) -> dict:
    with open(path) as f:
        trace = json.load(f)
    events = []

    def walk(node):
        if isinstance(node, dict):
            if "name" in node and "dur" in node:
                events.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(trace)
    masks = [e for e in events if e["name"] == "mask"]
    waits = [e for e in events if e["name"] == "await_mask"]
    rows = sum(e.get("args", {}).get("rows", 0) for e in masks)
    idle = [e for e in waits if e.get("args", {}).get("device_idle")]
    return {"mask_steps": len(masks), "mask_rows": rows,
            "mask_us_per_token": sum(e["dur"] for e in masks) / max(rows, 1),
            "mask_us_per_step": sum(e["dur"] for e in masks) / max(len(masks), 1),
            "await_mask_steps": len(waits), "steps_device_waited": len(idle),
            "device_wait_us_total": sum(e["dur"] for e in idle)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, 4 requests")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    args = parser.parse_args()
    out_dir = os.environ.get("OUT", "./gpu-out")
    os.makedirs(out_dir, exist_ok=True)
    smoke = args.smoke
    n = args.requests or (4 if smoke else 256)
    max_tokens = args.max_tokens or (8 if smoke else 256)
    vocab = 128256
    shape = "tiny" if smoke else "llama8b"
    print(f"building the model directory ({shape} shape, {vocab}-token vocabulary)", flush=True)
    path = model_dir(shape, vocab)
    from tokenmill import LLM, SamplingParams, StructuredOutputsParams
    trace = os.path.join(out_dir, "gpu_structured_trace.json")
    engine = dict(load_format="dummy", dtype="float32" if smoke else "bfloat16", max_num_seqs=max(n, 4),
                  max_model_len=1024, trace_steps=trace, structured_outputs_compile_timeout=120.0)
    if not smoke:
        engine["gpu_memory_utilization"] = 0.85
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(32)]} for _ in range(n)]
    plain = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    results, failures = {}, []
    with LLM(path, **engine) as llm:
        llm.generate(prompts[:4], plain, use_tqdm=False)  # warm-up (and the grammar compiled below)
        llm.generate(prompts[:4], constrained, use_tqdm=False)
        for name, params in (("unconstrained", plain), ("constrained", constrained), ("unconstrained_again", plain)):
            print(f"{name}: {n} requests x {max_tokens} tokens", flush=True)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            results[name] = {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}
            if name == "constrained":
                short = [o for o in outs if len(o.outputs[0].token_ids) != max_tokens]
                if short:
                    failures.append(f"{len(short)} constrained requests ended early: "
                                    f"{short[0].outputs[0].finish_reason}")
    base = (results["unconstrained"]["tok_s"] + results["unconstrained_again"]["tok_s"]) / 2
    ratio = results["constrained"]["tok_s"] / base
    figures = trace_figures(trace)
    record = {"device": _device(), "requests": n, "max_tokens": max_tokens, "vocab": vocab, **results,
              "ratio": ratio, **figures, "smoke": smoke}
    print(f"\n{'run':<22}{'tok/s':>12}{'seconds':>10}")
    for name in ("unconstrained", "constrained", "unconstrained_again"):
        print(f"{name:<22}{results[name]['tok_s']:>12.1f}{results[name]['seconds']:>10.2f}")
    print(f"ratio constrained / unconstrained: {ratio:.3f} (goal >= 0.95)")
    print(f"mask: {figures['mask_us_per_token']:.1f} us per token, {figures['mask_us_per_step']:.0f} us per step, "
          f"{figures['mask_steps']} steps; device waited for a mask in {figures['steps_device_waited']} of "
          f"{figures['await_mask_steps']} steps ({figures['device_wait_us_total'] / 1e3:.1f} ms in all)", flush=True)
    with open(os.path.join(out_dir, "gpu_structured.json"), "w") as f:  # kept if the check below dies
        json.dump(record, f, indent=1)
    record["speculative"] = spec_check(smoke, failures)
    if not smoke and ratio < 0.95:
        failures.append(f"ratio {ratio:.3f} < 0.95")
    record["failures"] = failures
    with open(os.path.join(out_dir, "gpu_structured.json"), "w") as f:
        json.dump(record, f, indent=1)
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


def spec_check(smoke: bool, failures: list[str]) -> dict:
    """Constrained greedy requests with and without speculation (n-gram, the model as its own
    draft): the same tokens, drafts really accepted, rejected and forbidden by the grammar."""
    import re

    from tests.helpers.tiny_models import make_tiny_model_dir
    from tokenmill import LLM, SamplingParams, StructuredOutputsParams
    path = make_tiny_model_dir("llama", tempfile.mkdtemp(prefix="tiny-spec-"))
    prompts = ["abcabcabcabcabcab", "xyz-xyz-xyz-xyz-x", "hello hello hello hel", "aaaaabbbbbaaaaabbbbb",
               "q1q2q3q1q2q3q1q2"] * (1 if smoke else 8)
    regexes = [r"[a-c]{30}", r"(xyz-|xy-){8}", r"[a-z ]{30}", r"(a|b){5}(c|b){20}", r"(q[0-9]){12}"] * (1 if smoke else 8)
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=r))
              for r in regexes]
    engine = dict(dtype="float32", kv_cache_memory_gb=0.5, single_process=True, gpu_memory_utilization=0.3)
    with LLM(path, **engine) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm  # in one process: the next engine sizes its KV pool from what this one leaves free
    _release_memory()
    record = {}
    for name, spec in (("ngram", {"method": "ngram", "num_speculative_tokens": 3, "max_step_tokens": 0}),
                       ("draft_model", {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                                        "max_step_tokens": 0})):
        print(f"speculative decoding with constraints: {name}", flush=True)
        with LLM(path, speculative_config=spec, **engine) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            stats, grammars = llm.scheduler_stats(), llm.engine.grammars
            forbidden, positions = grammars.num_drafts_forbidden, grammars.num_draft_positions
        del llm, grammars
        _release_memory()
        got = [o.outputs[0].token_ids for o in outs]
        valid = all(re.fullmatch(r, o.outputs[0].text) for r, o in zip(regexes, outs))
        drafted, accepted = stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]
        record[name] = {"same_tokens": got == want, "valid": valid, "draft_tokens": drafted,
                        "accepted": accepted, "draft_positions_masked": positions, "drafts_forbidden": forbidden}
        print(f"  same tokens as without speculation: {got == want}, outputs valid: {valid}, drafts "
              f"{drafted}, accepted {accepted}, forbidden by the grammar {forbidden}", flush=True)
        if got != want or not valid:
            failures.append(f"speculative decoding ({name}) with constraints changed the output")
        if not (0 < accepted < drafted) or not forbidden:
            failures.append(f"speculative decoding ({name}): drafts {drafted}, accepted {accepted}, forbidden "
                            f"{forbidden}: the check did not exercise acceptance, rejection and the grammar")
    return record


def _release_memory() -> None:
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _device() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    sys.exit(main())
