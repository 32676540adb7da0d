"""The CUDA-graph paths with LoRA, on CPU: the decode, verification and prompt-chunk graphs'
bodies run eagerly where CUDA would replay them, reading each row's adapter slot on the device
(as a replay does, whatever the adapter mix). Base and adapter requests mixed, with chunked
prefill and n-gram speculation, give HF + PEFT's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine import pin_spec_cost, worker_runner
from tests.lora.test_lora_engine import ENGINE, PROMPTS, Setup, run
from tokenmill import LLM
from tokenmill.worker.decode_graphs import DecodeGraphs
from tokenmill.worker.prompt_graphs import PromptGraphs


class _EagerReplay:
    def __init__(self, body, counter: list[int]) -> None:
        self.body, self.counter = body, counter

    def replay(self) -> None:
        self.body()
        self.counter[0] += 1


def _plain_body(graphs, size: int):
    """A body as captured for `plain_graphs` (without LoRA)."""
    graphs._plain = True
    try:
        return graphs._body(size)
    finally:
        graphs._plain = False


def _single_body(graphs, size: int):
    """A body as captured for `single_graphs` (every adapter row of one slot: LoRA inside the GEMMs)."""
    graphs._single = True
    try:
        return graphs._body(size)
    finally:
        graphs._single = False


def _decode_graphs(runner, query_len: int, counter: list[int], plain_counter: list[int],
                   single_counter: list[int] | None = None) -> DecodeGraphs:
    spec = runner.speculator
    graphs = DecodeGraphs(runner.model, runner.batch, runner.kv_caches, 8, runner.config.model.max_model_len,
                          runner.block_size, query_len=query_len, drafts=None if spec is None else spec.drafts,
                          lora=runner.lora)

    def body(size: int):
        graphs.logits[size] = graphs._body(size)

    def plain(size: int):
        graphs.logits[size] = _plain_body(graphs, size)
    graphs.graphs = {size: _EagerReplay(lambda size=size: body(size), counter) for size in graphs.sizes}
    graphs.plain_graphs = {size: _EagerReplay(lambda size=size: plain(size), plain_counter) for size in graphs.sizes}
    if runner.lora.concat_graphs and query_len == 1:  # (as `DecodeGraphs.capture`: sizes past the per-token kernels')
        from tokenmill.layers.lora import triton_lora

        def single(size: int):
            graphs.logits[size] = _single_body(graphs, size)
        graphs.single_graphs = {size: _EagerReplay(lambda size=size: single(size), single_counter)
                                for size in graphs.sizes if size > triton_lora.ROWS_MAX_TOKENS}
    with torch.inference_mode():  # as capture does first: the shared output buffer, of the largest size
        graphs._body(graphs.sizes[-1])
    return graphs


def install_eager_graphs(llm) -> dict[str, list[int]]:
    """Eager stand-ins for every graph family, each with its variant without LoRA (for steps
    without adapters) and the decode graphs' one-slot variant (where the manager has wider
    weights: `LoRAManager.concat`), counting replays of each."""
    runner = worker_runner(llm)
    counts = {k: [0] for k in ("decode", "verify", "prompt", "decode_plain", "verify_plain", "prompt_plain",
                               "decode_single")}
    runner.graphs = _decode_graphs(runner, 1, counts["decode"], counts["decode_plain"], counts["decode_single"])
    if runner.speculator is not None:
        runner.verify_graphs = _decode_graphs(runner, runner.speculator.k + 1, counts["verify"],
                                              counts["verify_plain"])
    prompt = PromptGraphs(runner.model, runner.batch, runner.kv_caches, runner.config.model.max_model_len,
                          runner.block_size, runner.config.scheduler.max_num_batched_tokens, lora=runner.lora)
    body = prompt._body

    def counted(size: int):
        counts["prompt"][0] += 1
        return body(size)

    def plain(size: int):  # (the body itself: `counted` counts the LoRA variant's runs)
        prompt._plain = True
        try:
            prompt.plain_logits[size] = body(size)
        finally:
            prompt._plain = False
    prompt._body = counted
    prompt.plain_graphs = {size: _EagerReplay(lambda size=size: plain(size), counts["prompt_plain"])
                           for size in prompt.sizes}
    runner.prompt_graphs = prompt
    return counts


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    return Setup(tmp_path_factory.mktemp("lora-graphs"), "qwen2")


@pytest.mark.parametrize("extra", [{}, {"max_num_batched_tokens": 8},
                                   {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                           "max_step_tokens": 0}}],
                         ids=["plain", "chunked", "ngram"])
def test_graph_bodies_with_adapters_equal_peft(setup, extra) -> None:
    names = [None, "a1", "a2", "a3", "a1", None]
    with LLM(setup.path, max_loras=3, max_num_seqs=8, **ENGINE, **extra) as llm:
        if "speculative_config" in extra:
            pin_spec_cost(llm)
        counts = install_eager_graphs(llm)
        outputs = run(llm, setup, names[:1], PROMPTS[:1])  # batch 1: its prefill replays the prompt graph
        outputs += run(llm, setup, names, PROMPTS)
    setup.check(outputs, names[:1] + names, PROMPTS[:1] + PROMPTS)
    assert counts["decode"][0] + counts["verify"][0] > 5 and counts["prompt_plain"][0] >= 1, counts
    if "speculative_config" in extra:
        assert counts["verify"][0] > 5, counts


def test_steps_without_adapters_replay_the_graphs_without_lora(setup) -> None:
    """A step none of whose rows has an adapter replays the variant captured without LoRA (decode
    and batch-1 prompt chunks); a step with one adapter row, the LoRA one: both give HF + PEFT's tokens."""
    names = [None, None, None, "a2", None]
    with LLM(setup.path, max_loras=3, max_num_seqs=8, **ENGINE) as llm:
        counts = install_eager_graphs(llm)
        outputs = run(llm, setup, names[:1], PROMPTS[:1])  # a base request alone: plain prompt + decode graphs
        plain = {k: v[0] for k, v in counts.items()}
        outputs += run(llm, setup, names[3:4], PROMPTS[3:4])  # an adapter alone: the LoRA graphs
        outputs += run(llm, setup, names, PROMPTS[:len(names)])  # mixed: the LoRA graphs while a2 runs
    setup.check(outputs, names[:1] + names[3:4] + names, PROMPTS[:1] + PROMPTS[3:4] + PROMPTS[:len(names)])
    assert plain["prompt_plain"] >= 1 and plain["decode_plain"] > 3 and plain["decode"] == plain["prompt"] == 0, plain
    assert counts["decode"][0] > plain["decode"] and counts["prompt"][0] >= 1, counts


@pytest.mark.parametrize("single_ms,kept", [(9.0, True), (11.0, False)])
def test_one_slot_decode_family_kept_only_where_it_replays_faster(monkeypatch, single_ms, kept) -> None:
    """Start-up's A/B (`DecodeGraphs._single_pays`): the largest size of each family replayed with
    every row of one slot (the scratch row given slot 0, then given back -1), the faster kept."""
    from types import SimpleNamespace

    from tokenmill.worker import decode_graphs

    general, single = object(), object()
    monkeypatch.setattr(decode_graphs, "replay_ms", lambda graph, replays: 10.0 if graph is general else single_ms)
    calls = []
    lora = SimpleNamespace(set_row=lambda row, slot: calls.append(("row", row, slot)),
                           load_concat=lambda slot: calls.append(("load", slot)))
    fake = SimpleNamespace(single_graphs={32: None, 64: single}, graphs={32: None, 64: general},
                           batch=SimpleNamespace(scratch=7), lora=lora)
    assert DecodeGraphs._single_pays(fake) is kept
    assert calls == [("row", 7, 0), ("load", 0), ("row", 7, -1)], calls
