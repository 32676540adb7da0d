"""PEFT adapter folders checked against the base model, and what is refused (naming the adapter
and why): through `LLM.generate`, which fails before any work and keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoModelForCausalLM

from tests.helpers.lora_adapters import PeftAdapters
from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill import LLM, SamplingParams
from tokenmill.lora.peft import LoRAAdapterError, LoRANotFoundError
from tokenmill.lora.request import LoRARequest

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.01, single_process=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-adapters")
    path = make_tiny_model_dir("llama", root)
    peft = PeftAdapters(AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval())
    good = peft.add("good", root / "a", rank=8)
    big = peft.add("big", root / "a", rank=32, alpha=32)
    other_base = make_tiny_model_dir("llama", root / "wide", intermediate_size=96)
    wrong = PeftAdapters(AutoModelForCausalLM.from_pretrained(other_base, dtype="float32").eval()).add(
        "wrong", root / "b", targets=("down_proj",))
    head = root / "head"
    shutil.copytree(good, head)
    config = json.loads((head / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "lm_head"]
    (head / "adapter_config.json").write_text(json.dumps(config))
    return dict(model=path, good=good, big=big, wrong=wrong, head=str(head), missing=str(root / "nowhere"))


@pytest.mark.parametrize("which,error,words", [
    ("missing", LoRANotFoundError, "no adapter folder"),
    ("big", LoRAAdapterError, "rank r=32 exceeds max_lora_rank=16"),
    ("wrong", LoRAAdapterError, r"down_proj.lora_A.weight' has shape \[8, 96\], expected \[8, 128\]"),
    ("head", LoRAAdapterError, "'lm_head': LoRA on embeddings or the LM head is not supported"),
])
def test_bad_adapters_fail_only_their_call(folders, which, error, words) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0)
    with LLM(folders["model"], enable_lora=True, max_lora_rank=16, **ENGINE) as llm:
        with pytest.raises(error, match=words):
            llm.generate(["hi", "there"], params, use_tqdm=False,
                         lora_request=[None, LoRARequest(which, 1, folders[which])])
        assert llm.kv_cache_stats()["num_requests"] == 0  # nothing was submitted
        out = llm.generate(["hi"], params, use_tqdm=False, lora_request=LoRARequest("good", 2, folders["good"]))
        assert len(out[0].outputs[0].token_ids) == 3


def test_lora_needs_enable_lora(folders) -> None:
    with LLM(folders["model"], **ENGINE) as llm:
        with pytest.raises(ValueError, match="enable_lora"):
            llm.generate(["hi"], use_tqdm=False, lora_request=LoRARequest("good", 1, folders["good"]))


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_loras=0), "max_loras"), (dict(max_lora_rank=0), "max_lora_rank"),
    (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
])
def test_bad_lora_limits_name_the_field(folders, kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        LLM(folders["model"], enable_lora=True, **kwargs, **ENGINE)


def test_graph_body_token_slots_are_dense() -> None:
    """`prepare_rows` of one row and a chunk of 16 tokens (the prompt-chunk graph): the step's
    token -> slot map is a dense tensor with the row's slot per token, not a stride-0 view."""
    import numpy as np
    import torch

    from tokenmill.layers.lora.lora_layer import LoRABatch
    from tokenmill.worker.lora_manager import LoRAManager

    manager = LoRAManager.__new__(LoRAManager)
    manager.batch = LoRABatch(torch.device("cpu"), 4)
    manager.row_slot_dev = torch.tensor([-1, 3, 2, -1], dtype=torch.int32)
    manager.prepare_rows(torch.tensor([1]), 16)
    slots = manager.batch.token_slots
    assert slots.stride() == (1,) and slots.tolist() == [3] * 16
    manager.prepare_rows(torch.tensor([2, 1]), 3)
    assert np.array_equal(manager.batch.token_slots.numpy(), [2, 2, 2, 3, 3, 3])


@pytest.mark.parametrize("file_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16"])
def test_packed_host_copy_equals_scaling_in_float32(file_dtype, model_dtype) -> None:
    """An adapter's host copy (`lora_manager.packed`: one buffer, one conversion pass, B scaled on
    the way) equals A in the model's dtype and B scaled in float32 and rounded once, whatever the
    file's dtype; each tensor its own contiguous part of the buffer."""
    import torch

    from tokenmill.worker.lora_manager import packed

    g = torch.Generator().manual_seed(0)
    file_dt, model_dt = getattr(torch, file_dtype), getattr(torch, model_dtype)
    pairs = {(layer, name): (torch.randn(8, 48, generator=g).to(file_dt),
                             torch.randn(40, 8, generator=g).to(file_dt)[:, :6])  # (a narrowed B: a view)
             for layer in range(2) for name in ("q_proj", "down_proj")}
    scaling = 0.37
    got = packed(pairs, model_dt, pin=False, scaling=scaling)
    ends = []
    for key, (a, b) in pairs.items():
        ga, gb = got[key]
        assert ga.dtype == gb.dtype == model_dt and ga.is_contiguous() and gb.is_contiguous()
        assert torch.equal(ga, a.to(model_dt))
        assert torch.equal(gb, (b.float() * scaling).to(model_dt)), key
        ends += [(ga.data_ptr(), ga.numel()), (gb.data_ptr(), gb.numel())]
    size = torch.empty((), dtype=model_dt).element_size()
    ends.sort()
    assert all(p0 + n0 * size <= p1 for (p0, n0), (p1, _) in zip(ends, ends[1:]))  # no two overlap
