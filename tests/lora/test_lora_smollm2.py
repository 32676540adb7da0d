"""The real SmolLM2-135M-Instruct (GGUF, loaded into an HF model by transformers) with two random
PEFT adapters: base and adapter requests mixed in one batch give HF + PEFT's greedy tokens."""

from __future__ import annotations

import pytest

from tests.helpers.hf_reference import compare_greedy
from tests.helpers.lora_adapters import PeftAdapters
from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

pytestmark = pytest.mark.slow
NEW = 8


def test_smollm2_two_adapters_mixed(smollm2_hf, tmp_path) -> None:
    peft = PeftAdapters(smollm2_hf)
    loras = {
        "all": LoRARequest("all", 1, peft.add("all", tmp_path, rank=16, alpha=32, seed=1, std=0.05)),
        "attn": LoRARequest("attn", 2, peft.add("attn", tmp_path, rank=8, alpha=8, seed=2, std=0.08,
                                                targets=("q_proj", "k_proj", "v_proj", "o_proj"), use_rslora=True)),
    }
    tokenizer_prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    with LLM("smollm2", dtype="float32", max_model_len=512, kv_cache_memory_gb=0.05, single_process=True,
             enable_lora=True, max_loras=2, max_lora_rank=16) as llm:
        prompts = [llm.tokenizer(p).input_ids for p in tokenizer_prompts]
        names = [None, "all", "attn"] * 2
        batch = [prompts[i % 3] for i in range(6)]
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch],
                               SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True), use_tqdm=False,
                               lora_request=[None if n is None else loras[n] for n in names])
    refs = {(name, i): peft.greedy(name, prompts[i], NEW) for name in (None, "all", "attn") for i in range(3)}
    notes, changed = [], 0
    for row, (out, name, prompt) in enumerate(zip(outputs, names, batch)):
        ref = refs[(name, row % 3)]
        if name is not None:
            changed += ref.token_ids != refs[(None, row % 3)].token_ids
        note = compare_greedy(list(out.outputs[0].token_ids), ref, f"{name} {prompt}")
        if note:
            notes.append(note)
    assert len(notes) <= 1, notes
    assert changed >= 2  # the adapters change what the model says
