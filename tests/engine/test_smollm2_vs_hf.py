"""The real SmolLM2-135M-Instruct GGUF: 16 prompts of 5 to 600 tokens together, 64 greedy tokens each, vs HF."""

from __future__ import annotations

import pytest

from tests.helpers.engine import worker_runner
from tests.helpers.hf_reference import assert_greedy_matches_hf, compare_greedy, hf_greedy, hf_teacher_forced
from tokenmill import LLM, SamplingParams

LENGTHS = [5, 8, 13, 21, 34, 55, 89, 120, 160, 210, 270, 330, 400, 470, 540, 600]
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from wine-making. Within decades, print "
    "shops spread across Europe. Books became cheaper, literacy rose, and ideas travelled faster than ever. "
    "Scientists shared results, reformers spread pamphlets, and merchants printed price lists. Meanwhile, "
    "in a small kitchen far away, a cook is writing down a recipe: mix two cups of flour with a pinch of salt, "
    "add warm water slowly, knead the dough for ten minutes, then let it rest under a damp cloth. "
    "Question: what are the three most important inventions of the last thousand years, and why? Answer: "
)


def prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer(TEXT * 12).input_ids
    assert len(ids) >= max(LENGTHS)
    # Different starting points so that prompts do not all share one prefix.
    return [ids[(i * 37) % 200:(i * 37) % 200 + n] for i, n in enumerate(LENGTHS)]


@pytest.mark.slow
def test_sixteen_prompts_match_hf_token_for_token(smollm2_llm, smollm2_hf):
    """In-process with async scheduling (the shared engine), and multi-process with it off."""
    batch = prompts(smollm2_llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in batch]
    filled = worker_runner(smollm2_llm).num_placeholders_filled
    runs = {"single-process, async": smollm2_llm.generate(requests, params, use_tqdm=False)}
    assert worker_runner(smollm2_llm).num_placeholders_filled > filled, "the shared engine ran sync"
    with LLM("smollm2", dtype="float32", max_model_len=2048, kv_cache_memory_gb=0.5,
             async_scheduling=False) as multiprocess:
        runs["multi-process, sync"] = multiprocess.generate(requests, params, use_tqdm=False)
    # HF's greedy tokens teacher-forced on ours: one forward a prompt, not 64 decode steps (the same
    # check up to the first divergence; measured equal to the greedy loop's tokens, 16 of 16 prompts).
    refs = {}
    for mode, outs in runs.items():
        ours = [list(o.outputs[0].token_ids) for o in outs]
        assert [len(t) for t in ours] == [64] * len(batch), mode
        for prompt, tokens in zip(batch, ours):
            if (key := tuple(prompt + tokens)) not in refs:
                refs[key] = hf_teacher_forced(smollm2_hf, prompt, tokens)
        assert_greedy_matches_hf(ours, [refs[tuple(p + t)] for p, t in zip(batch, ours)], mode)


@pytest.mark.slow
def test_text_prompt_and_chat(smollm2_llm, smollm2_hf):
    tokenizer = smollm2_llm.get_tokenizer()
    out = smollm2_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8),
                               use_tqdm=False)[0]
    ref = hf_greedy(smollm2_hf, tokenizer("The capital of France is").input_ids, 8,
                    eos_token_ids=smollm2_llm.config.model.eos_token_ids)
    assert compare_greedy(out.outputs[0].token_ids, ref) is None
    assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert "Paris" in out.outputs[0].text
    chat = smollm2_llm.chat([{"role": "user", "content": "What is 2+2? Answer with one number."}],
                            SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert chat.prompt_token_ids[:1] == tokenizer("<|im_start|>").input_ids
    assert chat.outputs[0].finish_reason in ("stop", "length") and chat.outputs[0].text
