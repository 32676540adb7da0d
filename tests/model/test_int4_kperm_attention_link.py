"""`int4_kperm.mark_producers` links a Llama attention to its INT4 o_proj (TOKENMILL_INT4_KPERM_ATTN=1)
only where the attention says its Triton kernels' output goes to o_proj alone
(`LlamaAttention.o_proj_reads_attend_output`): not over another backend, not where a family
overrides `forward` (gpt-oss sets its sinks there), not with the switch off. The kernels' permuted
store itself: tests/layers/test_int4_kperm.py::test_attention_writes_the_k_order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.config import ModelArch
from tokenmill.distributed.parallel_state import ParallelContext
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend
from tokenmill.layers.attention.triton_backend import TritonAttentionBackend
from tokenmill.layers.quantization import int4_kperm
from tokenmill.model.gpt_oss import GptOssAttention
from tokenmill.model.llama import LlamaAttention

ARCH = ModelArch(architecture="LlamaForCausalLM", model_type="llama", vocab_size=64, hidden_size=128,
                 intermediate_size=256, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64,
                 rms_norm_eps=1e-5, max_position=256)
READER = "_int4_kperm_reader"


def _attention(cls=LlamaAttention, backend=TritonAttentionBackend) -> nn.Module:
    with torch.device("meta"):
        return cls(ARCH, backend, ParallelContext.single(ARCH))


@pytest.fixture
def every_linear_int4(monkeypatch):
    """Every linear stands for an INT4 one on the mma layout (the real check wants CUDA weights)."""
    monkeypatch.setattr(int4_kperm, "_int4_mma_linear", lambda layer: isinstance(layer, nn.Module))
    monkeypatch.setattr(int4_kperm, "ATTENTION", True)


def test_llama_attention_over_triton_links_its_o_proj(every_linear_int4):
    attn = _attention()
    assert attn.o_proj_reads_attend_output()
    assert int4_kperm.mark_producers(attn) == 1
    assert attn.__dict__[READER]() is attn.o_proj


@pytest.mark.parametrize("cls, backend", [(LlamaAttention, TorchRefAttentionBackend),
                                          (GptOssAttention, TritonAttentionBackend)])
def test_other_backends_and_overridden_forwards_are_not_linked(every_linear_int4, cls, backend):
    attn = _attention(cls, backend)
    assert not attn.o_proj_reads_attend_output()
    assert int4_kperm.mark_producers(attn) == 0 and READER not in attn.__dict__


def test_switch_off_links_nothing(every_linear_int4, monkeypatch):
    monkeypatch.setattr(int4_kperm, "ATTENTION", False)  # TOKENMILL_INT4_KPERM_ATTN unset (the default)
    attn = _attention()
    assert int4_kperm.mark_producers(attn) == 0 and READER not in attn.__dict__
