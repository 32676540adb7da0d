"""Structured outputs on the device: throughput with every request constrained vs none, same run.

    python scripts/gpu_structured.py               # H100: Llama-3.1-8B shape, dummy bf16 weights, 256 requests
    python scripts/gpu_structured.py --smoke       # CPU: a tiny shape, 4 requests (checks the script)
    python scripts/gpu_structured.py --core-bench  # CPU: the engine core's loop with the grammar thread on and off

The model has a synthetic 128,256-token vocabulary (a word-level tokenizer over random strings of
letters, digits, punctuation and JSON characters), so XGrammar's masks cover a real vocabulary's
width. Every constrained request follows a JSON schema of 128 required string properties: its
strings accept any token (the mask inside one allows ~116k tokens and needs the parser for every
token with a quote or a backslash, so each step's mask is real work) and have no counted
repetition (a `minLength` string makes XGrammar's accept cost grow with the position: 67 -> 476 us
per token). The schema cannot be finished in fewer than ~384 tokens, so no request ends before
`max_tokens`; even so each unconstrained twin gets its constrained request's output length as
`max_tokens`, so both runs do the same work. The runs alternate: constrained, unconstrained,
constrained, unconstrained. From the step trace: the grammar thread's feed time per token and
mask time per row, how long the core waited for the grammar thread, and how many steps the device
waited for a mask (the worker's `await_mask` spans whose forward pass had already finished when
the mask arrived). Writes $OUT/gpu_structured.json; exits 1 when the constrained run produced an
invalid prefix or finished early, or (full mode) the ratio is < 0.95.

`--core-bench` (CPU, a tiny model, 64 constrained rows): the same constrained requests with the
grammar work on its thread and on the core's loop (`--no-structured-outputs-mask-thread`, as
before), with the core's time per step blocked on grammar work from the trace.

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
NUM_FIELDS = 128
SCHEMA = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(NUM_FIELDS)},
          "required": [f"f{i}" for i in range(NUM_FIELDS)]}
_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?-_'\"{}[]()/\\"


def model_dir(shape: str, vocab: int, quote_fraction: float = 0.004) -> str:
    """config.json of `shape` and a word-level tokenizer of `vocab` random strings (ids 0-2 special).
    Inside a JSON string, XGrammar checks every token holding a quote or a backslash with its
    parser (~0.1-0.3 ms per row with a 128k vocabulary): `quote_fraction` of the tokens hold one,
    as in a real tokenizer (SmolLM2's: 199 of 49,152, 0.40%), the rest are drawn without them.
    quote_fraction=None draws every character alike, as before (12.3% of the tokens: ~30x the
    parser work of a real vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast
    rng = random.Random(0)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    plain = _CHARS.replace('"', "").replace("\\", "")
    quoted = 0 if quote_fraction is None else round(quote_fraction * vocab)
    while len(words) < vocab - quoted:
        chars = _CHARS if quote_fraction is None else plain
        words.setdefault("".join(rng.choice(chars) for _ in range(rng.randint(1, 8))), len(words))
    while len(words) < vocab:  # each holds a quote or a backslash somewhere
        word = [rng.choice(plain) for _ in range(rng.randint(0, 7))]
        word.insert(rng.randint(0, len(word)), rng.choice('"\\'))
        words.setdefault("".join(word), len(words))
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

    def named(name):
        return [e for e in events if e["name"] == name]
    masks, feeds, core_waits, waits = named("mask"), named("grammar_feed"), named("mask_wait"), named("await_mask")
    updates = named("update")
    idle_spans, sampled = named("mask_idle"), named("sample_masked")
    rows = sum(e.get("args", {}).get("rows", 0) for e in masks)
    tokens = sum(e.get("args", {}).get("tokens", 0) for e in feeds)
    idle = [e for e in waits if e.get("args", {}).get("device_idle")]
    return {"mask_steps": len(masks), "mask_rows": rows,
            "mask_us_per_token": sum(e["dur"] for e in masks) / max(rows, 1),
            "mask_us_per_step": sum(e["dur"] for e in masks) / max(len(masks), 1),
            "feed_tokens": tokens, "feed_us_per_token": sum(e["dur"] for e in feeds) / max(tokens, 1),
            "core_mask_waits": len(core_waits), "core_mask_wait_us_total": sum(e["dur"] for e in core_waits),
            "core_update_us_per_step": sum(e["dur"] for e in updates) / max(len(updates), 1),
            "await_mask_steps": len(waits), "steps_device_waited": len(idle),
            "device_wait_us_total": sum(e["dur"] for e in idle),
            # Exact (CUDA events): how long the device sat idle between a forward pass and its masks.
            "device_idle_steps": len(idle_spans), "device_idle_us_total": sum(e["dur"] for e in idle_spans),
            # The worker's host time from a mask's arrival to its step's sampling enqueued.
            "sample_masked_us_median": _median([e["dur"] for e in sampled]),
            "distinct_masks_per_step_median": _median([e.get("args", {}).get("distinct", 0) for e in masks])}


def _median(values: list) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


def print_figures(figures: dict) -> None:
    print(f"grammar thread: feed {figures['feed_us_per_token']:.1f} us per token; mask "
          f"{figures['mask_us_per_token']:.1f} us per row, {figures['mask_us_per_step']:.0f} us per step, "
          f"{figures['mask_steps']} steps", flush=True)
    print(f"core waited for the grammar thread {figures['core_mask_waits']} times "
          f"({figures['core_mask_wait_us_total'] / 1e3:.1f} ms in all); core update "
          f"{figures['core_update_us_per_step']:.0f} us per step", flush=True)
    print(f"device waited for a mask in {figures['steps_device_waited']} of {figures['await_mask_steps']} "
          f"steps: idle {figures['device_idle_us_total'] / 1e3:.1f} ms in all (CUDA events, "
          f"{figures['device_idle_steps']} steps; from forward launch to mask "
          f"{figures['device_wait_us_total'] / 1e3:.1f} ms); masked sampling on the worker's host "
          f"{figures['sample_masked_us_median']:.0f} us per step (median); distinct masks per step "
          f"{figures['distinct_masks_per_step_median']} (median)", flush=True)


_REFERENCE: dict = {}  # model directory -> the schema compiled by a fresh XGrammar compiler


def kernel_check(failures: list[str]) -> dict:
    """CUDA: the Triton mask kernel against the torch reference on a bf16 [256, 128256] logits
    block (half the rows masked, by 4 distinct masks), and its time (CUDA events, 20 runs)."""
    import torch

    from tokenmill.layers.sampling.token_bitmask import apply_bitmask_reference
    from tokenmill.layers.triton_ops.token_bitmask import apply_bitmask
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 256, 128256
    logits = torch.randn(rows, vocab, device="cuda", generator=gen).to(torch.bfloat16)
    bits = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), device="cuda", generator=gen,
                         dtype=torch.int64).to(torch.int32)
    which = torch.where(torch.arange(rows, device="cuda") % 2 == 0, torch.arange(rows, device="cuda") % 4,
                        -1).to(torch.int32)
    want, got = logits.clone(), logits.clone()
    apply_bitmask_reference(want, bits, which)
    apply_bitmask(got, bits, which)
    same = bool(torch.equal(got, want))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        apply_bitmask(got, bits, which)
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) / 20 * 1e3
    print(f"mask kernel (bf16 [{rows}, {vocab}], half the rows masked): equal to the torch reference: {same}; "
          f"{us:.0f} us per launch", flush=True)
    if not same:
        failures.append("the Triton mask kernel differs from the torch reference")
    return {"equal": same, "us_per_launch": us}


def constrained_outputs_valid(path: str, outs, failures: list[str]) -> None:
    """Each constrained output is a prefix a fresh XGrammar matcher accepts (not the engine's own)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    errors = [o for o in outs if o.outputs[0].finish_reason not in ("length", "stop")]
    if errors:
        failures.append(f"{len(errors)} constrained requests ended with {errors[0].outputs[0].finish_reason}")
    if path not in _REFERENCE:
        info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(path), vocab_size=128256,
                                                  stop_token_ids=[2])
        _REFERENCE[path] = xgr.GrammarCompiler(info).compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=True, strict_mode=True, max_whitespace_cnt=4)
    compiled = _REFERENCE[path]
    bad = 0
    for out in outs:
        matcher = xgr.GrammarMatcher(compiled)
        bad += not all(matcher.accept_token(t) for t in out.outputs[0].token_ids)
    if bad:
        failures.append(f"{bad} constrained outputs are not prefixes the grammar accepts")


def timed_runs(llm, path: str, prompts, max_tokens: int, rounds: int, failures: list[str]) -> dict:
    """Constrained, then the same prompts unconstrained with each request's constrained output
    length as max_tokens; `rounds` times."""
    from tokenmill import SamplingParams, StructuredOutputsParams
    constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    results: dict = {"constrained": [], "unconstrained": []}
    for r in range(rounds):
        for name in ("constrained", "unconstrained"):
            if name == "constrained":
                params = constrained
            else:
                params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
                          for n in lengths]
            print(f"{name} (round {r + 1}): {len(prompts)} requests", flush=True)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            got = [len(o.outputs[0].token_ids) for o in outs]
            results[name].append({"seconds": seconds, "tokens": sum(got), "tok_s": sum(got) / seconds})
            print(f"  {sum(got)} tokens in {seconds:.2f} s: {sum(got) / seconds:.1f} tok/s", flush=True)
            if name == "constrained":
                lengths = [max(n, 1) for n in got]
                constrained_outputs_valid(path, outs, failures)
                short = sum(n != max_tokens for n in got)
                if short:
                    failures.append(f"{short} constrained requests ended before max_tokens")
            elif got != lengths:
                failures.append("an unconstrained twin did not produce its constrained request's length")
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, 4 requests")
    parser.add_argument("--core-bench", action="store_true",
                        help="CPU, tiny shape: the grammar work on its thread vs on the core's loop")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-spec-check", action="store_true")
    parser.add_argument("--all-chars-vocab", action="store_true",
                        help="every vocabulary character equally likely (12%% of tokens hold a quote or a "
                             "backslash, ~30x a real tokenizer's parser work inside JSON strings)")
    args = parser.parse_args()
    out_dir = os.environ.get("OUT", "./gpu-out")
    os.makedirs(out_dir, exist_ok=True)
    if args.core_bench:
        return core_bench(args, out_dir)
    smoke = args.smoke
    n = args.requests or (4 if smoke else 256)
    max_tokens = args.max_tokens or (8 if smoke else 256)
    vocab = 128256
    shape = "tiny" if smoke else "llama8b"
    print(f"building the model directory ({shape} shape, {vocab}-token vocabulary)", flush=True)
    quote_fraction = None if args.all_chars_vocab else 0.004
    path = model_dir(shape, vocab, quote_fraction)
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
    failures: list[str] = []
    kernel = None if smoke else kernel_check(failures)
    with LLM(path, **engine) as llm:
        start = time.perf_counter()
        llm.generate(prompts[:4], plain, use_tqdm=False)  # warm-up (and the grammar compiled below)
        llm.generate(prompts[:4], constrained, use_tqdm=False)
        print(f"warm-up (grammar compiled): {time.perf_counter() - start:.1f} s", flush=True)
        results = timed_runs(llm, path, prompts, max_tokens, args.rounds, failures)
    total = {name: (sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)) for name, runs in results.items()}
    tok_s = {name: tokens / seconds for name, (tokens, seconds) in total.items()}
    ratio = tok_s["constrained"] / tok_s["unconstrained"]
    figures = trace_figures(trace)
    record = {"device": _device(), "requests": n, "max_tokens": max_tokens, "vocab": vocab, "schema_fields": NUM_FIELDS,
              "vocab_quote_fraction": quote_fraction,
              "runs": results, "tok_s": tok_s, "tokens": {k: v[0] for k, v in total.items()}, "ratio": ratio,
              **figures, "mask_kernel": kernel, "smoke": smoke}
    print(f"\n{'run':<16}{'round':>6}{'tokens':>9}{'tok/s':>12}{'seconds':>10}")
    for name, runs in results.items():
        for i, r in enumerate(runs):
            print(f"{name:<16}{i + 1:>6}{r['tokens']:>9}{r['tok_s']:>12.1f}{r['seconds']:>10.2f}")
    print(f"ratio constrained / unconstrained (all rounds): {ratio:.3f} (goal >= 0.95)")
    print_figures(figures)
    with open(os.path.join(out_dir, "gpu_structured.json"), "w") as f:  # kept if the check below dies
        json.dump(record, f, indent=1)
    if not args.no_spec_check:
        record["speculative"] = spec_check(smoke, failures)
    if not smoke and ratio < 0.95:
        failures.append(f"ratio {ratio:.3f} < 0.95")
    record["failures"] = failures
    with open(os.path.join(out_dir, "gpu_structured.json"), "w") as f:
        json.dump(record, f, indent=1)
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


def core_bench(args, out_dir: str) -> int:
    """The same constrained requests on a tiny model (CPU), the grammar work on its thread and on
    the core's loop: tokens per second, and per step the core's update and its wait for masks."""
    from tokenmill import LLM, SamplingParams, StructuredOutputsParams
    n = args.requests or 64
    max_tokens = args.max_tokens or 48
    vocab = 128256
    print(f"building the model directory (tiny shape, {vocab}-token vocabulary)", flush=True)
    path = model_dir("tiny", vocab, None if args.all_chars_vocab else 0.004)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(16)]} for _ in range(n)]
    constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    record = {"requests": n, "max_tokens": max_tokens, "all_chars_vocab": args.all_chars_vocab}
    failures, tokens = [], {}
    for thread in (True, False):
        name = "grammar thread" if thread else "on the core's loop"
        trace = os.path.join(out_dir, f"core_bench_{'thread' if thread else 'loop'}_trace.json")
        with LLM(path, load_format="dummy", dtype="float32", max_num_seqs=n, max_model_len=512, trace_steps=trace,
                 structured_outputs_compile_timeout=120.0, structured_outputs_mask_thread=thread) as llm:
            llm.generate(prompts[:2], constrained, use_tqdm=False)  # the grammar compiled
            best = None
            for _ in range(args.rounds):
                start = time.perf_counter()
                outs = llm.generate(prompts, constrained, use_tqdm=False)
                seconds = time.perf_counter() - start
                best = seconds if best is None else min(best, seconds)
        tokens[thread] = [o.outputs[0].token_ids for o in outs]
        got = sum(len(t) for t in tokens[thread])
        figures = trace_figures(trace)
        steps = max(figures["mask_steps"], 1)
        record[name] = {"tok_s": got / best, "seconds": best, "tokens": got, **figures,
                        "core_mask_wait_us_per_step": figures["core_mask_wait_us_total"] / steps}
        print(f"\n{name}: {got / best:.1f} tok/s ({got} tokens, best of {args.rounds}: {best:.2f} s)")
        print_figures(figures)
    if tokens[True] != tokens[False]:
        failures.append("the grammar thread changed the tokens")
    on, off = record["grammar thread"], record["on the core's loop"]
    # On the loop, the feed and the mask run on the core's thread: that is the time it is blocked.
    blocked_off = (off["feed_us_per_token"] * off["feed_tokens"] + off["mask_us_per_step"] * off["mask_steps"]) / max(
        off["mask_steps"], 1)
    print(f"\ncore blocked on grammar work per step: on the loop {blocked_off / 1e3:.2f} ms, with the thread "
          f"{on['core_mask_wait_us_per_step'] / 1e3:.2f} ms; core update per step {off['core_update_us_per_step'] / 1e3:.2f}"
          f" -> {on['core_update_us_per_step'] / 1e3:.2f} ms; tok/s {off['tok_s']:.1f} -> {on['tok_s']:.1f}")
    record["core_blocked_ms_per_step"] = {"loop": blocked_off / 1e3, "thread": on["core_mask_wait_us_per_step"] / 1e3}
    record["failures"] = failures
    with open(os.path.join(out_dir, "core_bench.json"), "w") as f:
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
