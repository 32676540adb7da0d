"""A model split over ranks (TP=2, PP=2, TP=2 x PP=2: the mp executor, gloo) generates the same
greedy tokens as one process, for several model families, with async scheduling on and off.

Each case is one engine (test time is the budget): every family runs split by tensor
parallelism, TP=2 and TP=2 x PP=2 meet both scheduling modes, PP=2 alone runs sync here and
async in test_pp_lifecycle.py, test_pp_telemetry.py and test_ray_executor.py.
"""

from __future__ import annotations

import pytest

from tests.helpers.invariance import greedy_params
from tests.parallel.conftest import ENGINE, NEW_TOKENS, PROMPTS, assert_idle, assert_matches_one_process
from tokenmill import LLM

CASES = [  # (family, tensor_parallel_size, pipeline_parallel_size, async_scheduling, pp_layer_partition)
    ("llama", 2, 1, True, None),
    ("qwen2-mqa-tied", 2, 1, False, None),  # one KV head on two ranks: replicated
    ("qwen3", 1, 2, False, "measured"),  # rank 0 times a layer, the embedding and the head; all take its split
    ("qwen2-mqa-tied", 2, 2, True, "1,2"),  # the last stage holds its copy of the tied embedding
    ("qwen3", 2, 2, False, None),
    ("phi3", 2, 1, True, None),
    ("gemma2", 2, 2, False, None),
    ("gemma3", 1, 2, True, None),
    # Half layers: stage 0 also runs layer 1's attention, stage 1 its MLP (the boundary inside it).
    ("llama", 1, 2, True, "1.5,1.5"),
    ("qwen3", 2, 2, False, "1.5,1.5"),
]


@pytest.mark.parametrize("family,tp,pp,async_scheduling,partition", CASES,
                         ids=[f"{f}-tp{tp}-pp{pp}-{'async' if a else 'sync'}" + (f"-{p}" if p else "")
                              for f, tp, pp, a, p in CASES])
def test_split_model_matches_one_process(family_dirs, one_process_reference, family, tp, pp,
                                         async_scheduling, partition) -> None:
    reference = one_process_reference(family)
    with LLM(family_dirs[family], tensor_parallel_size=tp, pipeline_parallel_size=pp, pp_layer_partition=partition,
             async_scheduling=async_scheduling, **ENGINE) as llm:
        outputs = llm.generate(PROMPTS, greedy_params(NEW_TOKENS), use_tqdm=False)
        assert_matches_one_process(reference, outputs, f"{family} tp={tp} pp={pp} async={async_scheduling}")
        assert_idle(llm)


def test_three_micro_batches_on_two_stages(family_dirs, one_process_reference) -> None:
    """`pp_microbatches=3`: more batches in flight than stages (the bubble's fix), same tokens."""
    reference = one_process_reference("llama")
    with LLM(family_dirs["llama"], pipeline_parallel_size=2, pp_microbatches=3, **ENGINE) as llm:
        outputs = llm.generate(PROMPTS, greedy_params(NEW_TOKENS), use_tqdm=False)
        assert_matches_one_process(reference, outputs, "llama pp=2 with 3 micro-batches")
        assert_idle(llm)


@pytest.mark.parametrize("microbatches,partition", [(2, None), (3, None), (2, "1.5,1.5")])
def test_device_tokens_on_two_stages(family_dirs, one_process_reference, microbatches, partition) -> None:
    """`pp_device_tokens`: rows run on tokens still in flight, which the first stage takes from the
    last one's send (gloo here): the same tokens, and placeholders were really scheduled. With half
    layers too (the GPU bench's pp2-dt-h33.31)."""
    reference = one_process_reference("llama")
    with LLM(family_dirs["llama"], pipeline_parallel_size=2, pp_device_tokens=True, pp_microbatches=microbatches,
             pp_layer_partition=partition, **ENGINE) as llm:
        outputs = llm.generate(PROMPTS, greedy_params(NEW_TOKENS), use_tqdm=False)
        assert_matches_one_process(reference, outputs,
                                   f"llama pp=2 device tokens, {microbatches} micro-batches, split {partition}")
        assert_idle(llm)
        first = next(p for p in llm.telemetry().processes if p.role == "worker0")
        placeholders = first.channels.get("pp_placeholder_rows")
        assert placeholders is not None and placeholders.bytes_total > 0, "no row ran on a token in flight"


def test_device_tokens_with_tensor_parallel_stages(family_dirs, one_process_reference) -> None:
    """TP=2 x PP=2 with device tokens: each first-stage TP rank takes the tokens of its last-stage
    peer (a group per TP index), and both run rows on them."""
    reference = one_process_reference("qwen3")
    with LLM(family_dirs["qwen3"], tensor_parallel_size=2, pipeline_parallel_size=2, pp_device_tokens=True,
             **ENGINE) as llm:
        outputs = llm.generate(PROMPTS, greedy_params(NEW_TOKENS), use_tqdm=False)
        assert_matches_one_process(reference, outputs, "qwen3 tp=2 pp=2 device tokens")
        assert_idle(llm)
        for role in ("worker0", "worker1"):  # the first stage's two TP ranks
            first = next(p for p in llm.telemetry().processes if p.role == role)
            assert first.channels["pp_placeholder_rows"].bytes_total > 0, role
