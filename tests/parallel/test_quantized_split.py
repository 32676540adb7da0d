"""Quantized checkpoints split over ranks (mp executor, gloo) generate the greedy tokens of the same
checkpoint in one process: packed weights, group scales, act-order g_idx (whole on row-parallel
ranks), block scales and zero points are sharded and fused with their weights; an FP8 KV cache
under TP; a quantized model's pipeline stages hand over activations in the model's dtype."""

from __future__ import annotations

import pytest

from tests.helpers.invariance import greedy_params
from tests.helpers.quant_formats import write_quantized_model
from tests.parallel.conftest import ENGINE, NEW_TOKENS, PROMPTS, assert_idle, assert_matches_one_process
from tokenmill import LLM

CASES = {  # name -> (format, options, tensor_parallel_size, pipeline_parallel_size, engine extras)
    "gptq-actorder-tp2": ("gptq", {"group_size": 32, "sym": False, "desc_act": True}, 2, 1, {}),
    "fp8-block-tp2-kvfp8": ("fp8-block", {"block": (16, 16)}, 2, 1, {"kv_cache_dtype": "fp8"}),
    "awq-pp2": ("awq", {"group_size": 32}, 1, 2, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_split_matches_one_process(family_dirs, tmp_path, case):
    fmt, opts, tp, pp, extra = CASES[case]
    path, _ = write_quantized_model(family_dirs["llama"], tmp_path / case, fmt, with_refs=False, **opts)
    with LLM(path, single_process=True, async_scheduling=False, **ENGINE, **extra) as llm:
        reference = llm.generate(PROMPTS, greedy_params(NEW_TOKENS), use_tqdm=False)
    with LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE, **extra) as llm:
        outputs = llm.generate(PROMPTS, greedy_params(NEW_TOKENS), use_tqdm=False)
        assert_matches_one_process(reference, outputs, f"{case}")
        assert_idle(llm)
