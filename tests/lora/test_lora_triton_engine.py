"""The engine on the CUDA path's LoRA kernels: the step plan and the Triton shrink/expand (run by
the CPU interpreter) instead of the CPU's per-slot matmuls, through the graph bodies (run eagerly,
as `test_lora_graph_bodies` does). Batch-1 prefills replay the prompt-chunk body, whose token ->
slot map is one row's slot repeated (the path that read past that one slot on an H100), then a
mixed batch decodes; greedy tokens equal HF + PEFT's."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the first import

import pytest

from tests.helpers.triton_required import require_triton

require_triton()

from tests.helpers.engine import worker_runner  # noqa: E402
from tests.lora.test_lora_engine import ENGINE, PROMPTS, Setup, run  # noqa: E402
from tests.lora.test_lora_graph_bodies import install_eager_graphs  # noqa: E402
from tokenmill import LLM  # noqa: E402
from tokenmill.layers.lora import lora_layer, triton_lora  # noqa: E402
from tokenmill.layers.lora.triton_lora import plan_step  # noqa: E402
from tokenmill.model import llama  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    return Setup(tmp_path_factory.mktemp("lora-triton"), "qwen2")


@pytest.fixture
def triton_plans(monkeypatch):
    """Every step with an adapter gets the plan a CUDA step builds (so the Triton kernels run), and
    the decoder layers add each sublayer's output to the stream in the norm, as on CUDA (so
    o_proj's and down_proj's deltas go straight into the stream: `LoRASlots.forward`'s sink)."""
    monkeypatch.setattr(llama, "add_in_matmul", lambda hidden, residual: False)
    monkeypatch.setattr(lora_layer, "SINK_MODE", "always")  # (by default only beside the GEMM: CUDA graphs)
    prepare = lora_layer.LoRABatch.prepare

    def with_plan(self, token_slots, host=None, single=False):
        prepare(self, token_slots, host, single)
        if self.active:
            self.plan = plan_step(token_slots, self.num_slots, self.shapes)
            self.decide_concat(token_slots, host, single)
    monkeypatch.setattr(lora_layer.LoRABatch, "prepare", with_plan)


def test_engine_on_triton_kernels_equals_peft(setup, triton_plans) -> None:
    solo = [("a1", PROMPTS[0]), ("a3", PROMPTS[3])]  # at most 16 tokens: the per-token kernels
    names = [None, "a1", "a2", "a3"]
    with LLM(setup.path, max_loras=3, max_num_seqs=8, **ENGINE) as llm:
        counts = install_eager_graphs(llm)
        outputs = [run(llm, setup, [name], [prompt])[0] for name, prompt in solo]
        outputs += run(llm, setup, names, PROMPTS[:4])
    setup.check(outputs, [n for n, _ in solo] + names, [p for _, p in solo] + PROMPTS[:4])
    assert counts["prompt"][0] >= 2 and counts["decode"][0] > 5, counts


@pytest.fixture(scope="module")
def llama_setup(tmp_path_factory) -> Setup:
    """Llama (no biases): qkv's and gate_up's weights both go into wider buffers."""
    return Setup(tmp_path_factory.mktemp("lora-triton-llama"), "llama")


def test_one_slot_steps_with_lora_inside_the_gemm_equal_peft(llama_setup, triton_plans, monkeypatch) -> None:
    """Steps whose adapter rows all use one slot run qkv's and gate_up's LoRA inside their GEMMs
    (`triton_concat`: [x | t] against the wider weight holding that slot's B): eager prefills (the
    slot known on the host) and the one-slot decode graphs (the B put in before each replay); a
    step mixing two adapters replays the general graphs. Two device slots for three adapters: a1
    alone (with base rows), a2 and a3 mixed (a3 evicts a1: the slot whose B the wider weights
    hold is reloaded), a3 alone, a1 alone again. (A bias: `test_lora_kernels`.)"""
    setup = llama_setup
    monkeypatch.setattr(triton_lora, "ROWS_MAX_TOKENS", 2)  # (the one-slot path from 3 tokens: this test's batches)
    with LLM(setup.path, max_loras=2, max_num_seqs=8, **ENGINE) as llm:
        manager = worker_runner(llm).lora
        manager.concat = [s for (_, name), s in manager.slots.items() if name in ("qkv_proj", "gate_up_proj")
                          and s.attach_concat(cuda_only=False)]
        assert len(manager.concat) == 4, len(manager.concat)  # (2 layers: qkv and gate_up each)
        counts = install_eager_graphs(llm)
        runs = [(["a1", None, "a1", "a1"], PROMPTS[:4]), (["a2", "a3", "a2"], PROMPTS[1:4]),
                (["a3", "a3", None], PROMPTS[2:5]), (["a1", "a1", "a1"], PROMPTS[3:6])]
        outputs, names, prompts, single, general = [], [], [], [], []
        for n, p in runs:
            before = counts["decode_single"][0], counts["decode"][0]
            outputs += run(llm, setup, n, p)
            single.append(counts["decode_single"][0] - before[0])
            general.append(counts["decode"][0] - before[1])
            names += n
            prompts += p
    setup.check(outputs, names, prompts)
    # the mixed run replays the general graphs (a few one-slot steps as its rows finish), the others only one-slot ones
    assert all(s > 3 for s in single[:1] + single[2:]) and general[0] == general[2] == general[3] == 0, (single, general)
    assert general[1] > 3, (single, general)
