"""A model whose layers all slide (Mistral with `sliding_window`) gives back the blocks that fall
out of the window while its requests run: each decoding request holds at most
window / block_size + 2 blocks, and the blocks it gave back, reused by other requests at once,
change none of its tokens (greedy against HF)."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM

from tests.engine.conftest import tiny_llm
from tests.helpers.hf_reference import assert_greedy_matches_hf, hf_greedy
from tests.helpers.tiny_models import WINDOW, make_tiny_model_dir
from tokenmill import SamplingParams

BLOCK_SIZE = 4
BOUND = WINDOW // BLOCK_SIZE + 2


def test_decoding_requests_hold_at_most_the_window(tmp_path):
    path = make_tiny_model_dir("mistral-swa", tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in (60, 41, 70, 33, 55, 64)]
    refs = [hf_greedy(hf, p, 40) for p in prompts]
    # 24 blocks: fewer than the prompts' (82) or one full request's (28): only releasing makes room.
    llm = tiny_llm(path, block_size=BLOCK_SIZE, num_gpu_blocks_override=24, max_num_batched_tokens=16,
                   max_model_len=128)
    scheduler = llm.engine.scheduler
    assert scheduler.kv.window == WINDOW
    held_while_decoding: list[int] = []
    schedule = scheduler.schedule

    def observed():
        out = schedule()
        t = scheduler.table
        for slot in t.order.tolist():
            if t.num_computed[slot] > t.num_prompt[slot]:  # decoding
                held_while_decoding.append(scheduler.kv.num_held(int(t.handle[slot])))
        return out

    scheduler.schedule = observed
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert len(held_while_decoding) > 100
    assert max(held_while_decoding) <= BOUND, f"a decoding request held {max(held_while_decoding)} blocks"
    assert scheduler.kv.pool.num_evictions >= 0
    assert_greedy_matches_hf([o.outputs[0].token_ids for o in outs], refs, "mistral-swa, released blocks")
