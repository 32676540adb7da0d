"""Multi-LoRA through `LLM`: greedy tokens of base requests and of requests for several adapters,
mixed in one batch, equal HF transformers + PEFT's for each (float32, CPU, tiny random models of
two families); also with more adapters than device slots (eviction and reload mid-run), under
preemption, with the prefix cache on (never shared across adapters), and on TP=2."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from tests.helpers.engine import worker_runner
from tests.helpers.hf_reference import compare_greedy
from tests.helpers.lora_adapters import PeftAdapters
from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.01, single_process=True, enable_lora=True, max_lora_rank=16)
NEW = 10
PROMPTS = [[5, 6, 7, 8, 9], [10, 20, 30], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58],
           [100, 3, 100, 3], [77] * 9, [200, 150, 100, 50, 25, 12]]
# name -> how it is made: every projection kind, fused ones in part, ranks 4..16, rsLoRA.
ADAPTERS = {
    "a1": dict(rank=8, alpha=16, seed=1, std=0.3),
    "a2": dict(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), seed=2, std=0.5, use_rslora=True),
    "a3": dict(rank=16, alpha=32, targets=("k_proj", "o_proj", "gate_proj", "up_proj"), seed=3, std=0.3),
}


class Setup:
    def __init__(self, root, arch: str) -> None:
        self.path = make_tiny_model_dir(arch, root)
        base = AutoModelForCausalLM.from_pretrained(self.path, dtype="float32").eval()
        self.peft = PeftAdapters(base)
        self.loras = {name: LoRARequest(name, i + 1, self.peft.add(name, root / "adapters", **spec))
                      for i, (name, spec) in enumerate(ADAPTERS.items())}
        self._refs: dict = {}

    def ref(self, name: str | None, prompt: list[int]):
        key = (name, tuple(prompt))
        if key not in self._refs:
            self._refs[key] = self.peft.greedy(name, prompt, NEW)
        return self._refs[key]

    def check(self, outputs, names: list[str | None], prompts: list[list[int]]) -> None:
        notes = []
        for out, name, prompt in zip(outputs, names, prompts):
            note = compare_greedy(list(out.outputs[0].token_ids), self.ref(name, prompt), f"{name} {prompt}")
            if note:
                notes.append(note)
        assert len(notes) <= 1, notes

    def lora(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.loras[name]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    """Qwen2 (q/k/v biases): every test."""
    return Setup(tmp_path_factory.mktemp("lora-qwen2"), "qwen2")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Setup:
    """Qwen3 (q/k norms, head_dim != hidden / heads): the mixed batch."""
    return Setup(tmp_path_factory.mktemp("lora-qwen3"), "qwen3")


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def run(llm: LLM, setup: Setup, names: list[str | None], prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False,
                        lora_request=[setup.lora(n) for n in names])


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_adapters_change_the_outputs(request, family) -> None:
    setup = request.getfixturevalue("setup" if family == "qwen2" else "qwen3")
    for name in ADAPTERS:
        assert any(setup.ref(name, p).token_ids != setup.ref(None, p).token_ids for p in PROMPTS), name


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_mixed_batch_equals_peft(request, family) -> None:
    setup = request.getfixturevalue("setup" if family == "qwen2" else "qwen3")
    names = [None, "a1", "a2", "a3"] * 3
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    with LLM(setup.path, max_loras=3, **ENGINE) as llm:
        outputs = run(llm, setup, names, prompts)
        loads = llm.engine.scheduler.loras.num_loads
        read_ahead = worker_runner(llm).lora.num_read_ahead
    setup.check(outputs, names, prompts)
    assert loads == 3  # each adapter put in a slot once
    assert read_ahead == 3  # each read from disk in the background, from its request's arrival


def test_more_adapters_than_slots(setup) -> None:
    """One device slot, one adapter in host memory: adapters take turns, each switch evicts."""
    names = ["a1", "a2", None, "a3", "a1", "a2", "a3", None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    with LLM(setup.path, max_loras=1, max_cpu_loras=1, **ENGINE) as llm:
        outputs = run(llm, setup, names, prompts)
        scheduler, lora = llm.engine.scheduler, worker_runner(llm).lora
        assert scheduler.loras.num_loads == 3  # requests of the adapter in the slot go first
        again = run(llm, setup, names[:3], prompts[:3])
        # a1 and a2 came back after their eviction, read from disk again (one in host memory)
        assert scheduler.loras.num_loads == 5 and lora.num_reads == 5
    setup.check(outputs, names, prompts)
    setup.check(again, names[:3], prompts[:3])


def test_preemption(setup) -> None:
    names = ["a1", None, "a2", "a3", "a1", "a2"]
    with LLM(setup.path, max_loras=3, num_gpu_blocks_override=6, max_model_len=96, **ENGINE) as llm:
        outputs = run(llm, setup, names, PROMPTS)
        assert llm.scheduler_stats()["num_preemptions"] > 0
    setup.check(outputs, names, PROMPTS)


def test_prefix_cache_is_per_adapter(setup) -> None:
    """The same 40-token prompt under a1, then a2 and the base model: blocks cached for a1 must
    not serve them (their KV differs); a2 again hits its own."""
    prompt = [(7 * i) % 250 + 3 for i in range(40)]
    with LLM(setup.path, max_loras=2, enable_prefix_caching=True, **ENGINE) as llm:
        first = run(llm, setup, ["a1"], [prompt])
        later = run(llm, setup, ["a2", None], [prompt, prompt])
        assert all(out.num_cached_tokens == 0 for out in later)
        repeat = run(llm, setup, ["a2"], [prompt])
        assert repeat[0].num_cached_tokens >= 32
    setup.check(first + later + repeat, ["a1", "a2", None, "a2"], [prompt] * 4)


def test_tensor_parallel_2(setup) -> None:
    names = [None, "a1", "a2", "a3"]
    engine = {**ENGINE, "single_process": False}
    with LLM(setup.path, max_loras=2, tensor_parallel_size=2, **engine) as llm:
        outputs = run(llm, setup, names, PROMPTS[:4])
    setup.check(outputs, names, PROMPTS[:4])


def test_pipeline_parallel_2(setup) -> None:
    """Each stage holds its layers' adapter slices; with more adapters than slots (reloads on both
    stages). The same tokens as one stage's engine, and HF + PEFT's."""
    names = [None, "a1", "a2", "a3", "a1", None]
    engine = {**ENGINE, "single_process": False}
    with LLM(setup.path, max_loras=2, pipeline_parallel_size=2, **engine) as llm:
        outputs = run(llm, setup, names, PROMPTS)
    with LLM(setup.path, max_loras=2, **ENGINE) as llm:
        single = run(llm, setup, names, PROMPTS)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in single]
    setup.check(outputs, names, PROMPTS)


def test_a_step_never_holds_more_adapters_than_slots(setup) -> None:
    names = ["a1", "a2", "a3", None] * 3
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    with LLM(setup.path, max_loras=2, max_cpu_loras=3, **ENGINE) as llm:
        scheduler = llm.engine.scheduler
        schedule, most = scheduler.schedule, []

        def counting():
            out = schedule()
            most.append(len({r.lora.id for r in scheduler.running if r.lora is not None}))
            return out

        scheduler.schedule = counting
        outputs = run(llm, setup, names, prompts)
        assert max(most) == 2 and worker_runner(llm).lora.num_reads == 3
    setup.check(outputs, names, prompts)
