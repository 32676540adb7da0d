"""XGrammar against LLGuidance on SmolLM2's vocabulary: compile time, and the time to fill one row's
mask and accept its token, along a valid output of a JSON schema (205 tokens). LLGuidance is not a
dependency: `pip install llguidance` first. See docs/structured-outputs.md."""
import json
import time

import numpy as np
from tokenmill.model.default_model import resolve_model_path
from tokenmill.model.tokenizer import load_tokenizer
tok = load_tokenizer(resolve_model_path("smollm2"))
V = 49152
schema = {"type": "object", "properties": {"text": {"type": "string"}, "items": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}, "label": {"type": "string"}}, "required": ["id", "label"]}}}, "required": ["text", "items"]}
doc = json.dumps({"text": "The quick brown fox jumps over the lazy dog while the mill wheel turns by the river " * 3,
                  "items": [{"id": i, "label": f"label number {i} of the list"} for i in range(8)]})
ids = tok(doc, add_special_tokens=False).input_ids
print("tokens", len(ids))
import xgrammar as xgr
t = time.perf_counter(); info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[2]); t_info = time.perf_counter() - t
comp = xgr.GrammarCompiler(info, cache_enabled=False)
t = time.perf_counter(); g = comp.compile_json_schema(json.dumps(schema), any_whitespace=True); t_c = time.perf_counter() - t
m = xgr.GrammarMatcher(g); bm = np.zeros((1, (V + 31) // 32), np.int32)
t = time.perf_counter()
for i in ids:
    m.fill_next_token_bitmask(bm); assert m.accept_token(i)
t_x = (time.perf_counter() - t) / len(ids)
print(f"xgrammar: tokenizer info {t_info*1e3:.0f} ms, compile {t_c*1e3:.1f} ms, mask+accept {t_x*1e6:.1f} us/token")
import llguidance, llguidance.hf, llguidance.numpy
t = time.perf_counter(); lt = llguidance.hf.from_tokenizer(tok, n_vocab=V); t_info = time.perf_counter() - t
t = time.perf_counter(); grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)); lm = llguidance.LLMatcher(lt, grammar); t_c = time.perf_counter() - t
assert not lm.is_error(), lm.get_error()
bm2 = llguidance.numpy.allocate_token_bitmask(1, V)
t = time.perf_counter()
for i in ids:
    llguidance.numpy.fill_next_token_bitmask(lm, bm2, 0); assert lm.consume_token(i), lm.get_error()
t_l = (time.perf_counter() - t) / len(ids)
print(f"llguidance: tokenizer {t_info*1e3:.0f} ms, compile+matcher {t_c*1e3:.1f} ms, mask+accept {t_l*1e6:.1f} us/token")
