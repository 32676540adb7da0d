"""XGrammar against LLGuidance on SmolLM2's vocabulary: compile time, and the time to fill one row's
mask and accept its token, along a valid output of a JSON schema (about 200 tokens). LLGuidance is
not a dependency: `pip install llguidance` first. See docs/structured-outputs.md."""

import json
import time

import numpy as np

from tokenmill.model.default_model import resolve_model_path
from tokenmill.model.tokenizer import load_tokenizer

V = 49152
SCHEMA = {"type": "object", "properties": {
    "text": {"type": "string"},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "label": {"type": "string"}}, "required": ["id", "label"]}}},
    "required": ["text", "items"]}
DOC = json.dumps({"text": "The quick brown fox jumps over the lazy dog while the mill wheel turns by the river " * 3,
                  "items": [{"id": i, "label": f"label number {i} of the list"} for i in range(8)]})


def xgrammar(tokenizer, ids):
    import xgrammar as xgr
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=V, stop_token_ids=[2])
    made = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA))
    compiled_at = time.perf_counter()
    matcher, bitmask = xgr.GrammarMatcher(compiled), np.zeros((1, (V + 31) // 32), np.int32)
    for token in ids:
        matcher.fill_next_token_bitmask(bitmask)
        assert matcher.accept_token(token)
    return made - start, compiled_at - made, (time.perf_counter() - compiled_at) / len(ids)


def llguidance(tokenizer, ids):
    import llguidance
    import llguidance.hf
    import llguidance.numpy
    start = time.perf_counter()
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=V)
    made = time.perf_counter()
    matcher = llguidance.LLMatcher(lltokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    compiled_at = time.perf_counter()
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.numpy.allocate_token_bitmask(1, V)
    for token in ids:
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        assert matcher.consume_token(token), matcher.get_error()
    return made - start, compiled_at - made, (time.perf_counter() - compiled_at) / len(ids)


def main() -> None:
    tokenizer = load_tokenizer(resolve_model_path("smollm2"))
    ids = tokenizer(DOC, add_special_tokens=False).input_ids
    print(f"{len(ids)} tokens")
    for name, run in (("xgrammar", xgrammar), ("llguidance", llguidance)):
        vocab_s, compile_s, per_token_s = run(tokenizer, ids)
        print(f"{name}: vocabulary {vocab_s * 1e3:.0f} ms, compile {compile_s * 1e3:.1f} ms, "
              f"mask + accept {per_token_s * 1e6:.1f} us/token")


if __name__ == "__main__":
    main()
