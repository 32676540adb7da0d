"""Each linear decides how it computes once per state (`Linear.rebind`), never per call.

- Decode steps of a loaded float32 model make no decision at all: no rebind, no weight checks
  (`cpu_gemm.takes_weight` / `supports`), and every projection goes straight to the C kernel
  (the generic `linear` and its checks only for the LM head, once a step). Planted: `Linear.forward` rebinding before each
  call fails the rebind count; a bound function that goes through `linear` fails the kernel count.
- The state's changes rebind: LoRA slots attached and removed (planted: the `lora` setter without
  the rebind fails), `wide_output` set on a bf16 row-parallel layer (planted: its setter without
  the rebind fails), a layer built on the meta device then allocated and loaded (planted: no
  rebind in `_apply` fails: the bound function still holds the meta weight), and a deep copy
  (planted: no rebind in `__setstate__` fails: the copy computes with the original's weight).
"""

from __future__ import annotations

import copy
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.paged_batch import PagedRunner
from tests.helpers.tiny_models import make_tiny_model_dir
from tokenmill.layers import cpu_gemm, cpu_logits
from tokenmill.layers import linear as linear_mod
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend
from tokenmill.layers.linear import Linear
from tokenmill.layers.lora.lora_layer import LoRABatch, LoRASlots
from tokenmill.layers.parallel_linear import RowParallelLinear
from tokenmill.model.arch import model_arch
from tokenmill.model.hf_config import load_hf_config
from tokenmill.model.loader import load_model

_ONE_RANK = SimpleNamespace(layout=SimpleNamespace(tp_rank=0), tp_size=1, all_reduce=lambda t: t)  # no TP


def _counting(monkeypatch: pytest.MonkeyPatch, counts: Counter, owner, name: str, key: str) -> None:
    inner = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[key] += 1
        return inner(*args, **kwargs)
    monkeypatch.setattr(owner, name, counted)


@pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler for the float32 decode kernel")
def test_decode_steps_decide_nothing(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_model_dir("llama", tmp_path)
    arch = model_arch(load_hf_config(path))
    model = load_model(path, arch, "auto", torch.float32, torch.device("cpu"), TorchRefAttentionBackend)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * arch.num_layers
    runner = PagedRunner(model, arch.num_layers, arch.num_kv_heads, arch.head_dim, num_seqs=2, max_len=24)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    expected = runner.generate_greedy(prompts, 4)  # (before counting: the same tokens after)

    counts: Counter = Counter()
    _counting(monkeypatch, counts, Linear, "rebind", "rebind")
    _counting(monkeypatch, counts, RowParallelLinear, "rebind", "rebind")
    _counting(monkeypatch, counts, cpu_gemm, "takes_weight", "bind-time weight checks")
    _counting(monkeypatch, counts, cpu_gemm, "supports", "per-call checks")
    _counting(monkeypatch, counts, cpu_gemm, "linear", "C kernel")
    _counting(monkeypatch, counts, linear_mod, "linear", "generic linear")
    runner = PagedRunner(model, arch.num_layers, arch.num_kv_heads, arch.head_dim, num_seqs=2, max_len=24)
    lens = [len(p) for p in prompts]
    runner.step(prompts, lens)
    counts.clear()  # decode steps only (2 rows each: the C kernel's)
    out = [[t] for t in expected_first(expected)]
    steps = 3
    for _ in range(steps):
        lens = [n + 1 for n in lens]
        logits = runner.step([[seq[-1]] for seq in out], lens)
        for seq, t in zip(out, logits.argmax(-1).tolist()):
            seq.append(t)
    assert out == expected
    assert counts["rebind"] == 0 and counts["bind-time weight checks"] == 0, counts
    # Every projection's call is the C kernel's, unchecked (none through the generic `linear`);
    # only the LM head (not a `Linear`, one a step) makes its checks (`parallel_linear.linear`).
    assert counts["C kernel"] == steps * (len(linears) + 1), counts
    assert counts["generic linear"] == 0 and counts["per-call checks"] == steps, counts


def expected_first(seqs: list[list[int]]) -> list[int]:
    return [s[0] for s in seqs]


def test_lora_slots_attached_and_removed_rebind() -> None:
    gen = torch.Generator().manual_seed(0)
    layer = Linear(16, 8, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(8, 16, generator=gen))
    x = torch.randn(3, 16, generator=gen)
    a, b = torch.randn(4, 16, generator=gen), torch.randn(8, 4, generator=gen)
    batch = LoRABatch(torch.device("cpu"), num_slots=1)
    slots = LoRASlots(batch, 1, 4, 16, [8], torch.float32, torch.device("cpu"))
    slots.set_slot(0, 0, a, b)
    batch.prepare(torch.tensor([0, -1, 0]))
    base = x @ layer.weight.detach().t()
    delta = (x @ a.t()) @ b.t() * torch.tensor([1.0, 0.0, 1.0])[:, None]
    with torch.no_grad():
        torch.testing.assert_close(layer(x), base)
        layer.lora = slots
        torch.testing.assert_close(layer(x), base + delta)
        batch.prepare(torch.tensor([-1, -1, -1]))  # a step without adapter tokens: the base alone
        torch.testing.assert_close(layer(x), base)
        batch.prepare(torch.tensor([0, -1, 0]))
        layer.lora = None
        torch.testing.assert_close(layer(x), base)


@pytest.mark.skipif(not cpu_logits.available(), reason="no C compiler for the bf16 -> f32 kernel")
def test_wide_output_set_rebinds() -> None:
    layer = RowParallelLinear(32, 16, bias=False, parallel=_ONE_RANK).to(torch.bfloat16)
    x = torch.randn(2, 32).bfloat16()
    with torch.no_grad():
        assert layer(x).dtype == torch.bfloat16
        layer.wide_output = True
        assert layer(x).dtype == torch.float32 and layer.forward_add(x, torch.zeros(2, 16)).dtype == torch.float32
        layer.wide_output = False
        assert layer(x).dtype == torch.bfloat16


def test_built_on_meta_then_loaded_computes_with_the_loaded_weight() -> None:
    with torch.device("meta"):
        layer = Linear(16, 8, bias=True)
    layer.to_empty(device="cpu")
    w, bias = torch.randn(8, 16), torch.randn(8)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(bias)
        x = torch.randn(1, 16)
        torch.testing.assert_close(layer(x), x @ w.t() + bias)


def test_a_copy_computes_with_its_own_weight() -> None:
    layer = Linear(16, 8, bias=False)
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.mul_(2.0)
        x = torch.randn(1, 16)
        torch.testing.assert_close(twin(x), x @ twin.weight.t())
        torch.testing.assert_close(layer(x), x @ layer.weight.t())
