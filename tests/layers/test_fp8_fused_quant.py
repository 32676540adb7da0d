"""The fp8 activation quantization fused into the RMSNorm before a W8A8 linear
(tokenmill/layers/quantization/triton_fp8_fused.py) under TRITON_INTERPRET=1: the output equals
the unfused kernel's (triton_ops.rms_norm / fused_add_rms_norm) and its codes and scales equal the
torch reference's quantization of that output (fp8_ops.quantize_rows); and which norms the fp8
method marks in a Llama model.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers.requirements import require_module
from tokenmill.layers.quantization import fp8_ops

require_module("triton")  # skipped on a machine without it; in CI, missing fails


def _codes_match(out: torch.Tensor) -> None:
    q, s = fp8_ops.attached(out)
    ref_q, ref_s = fp8_ops.quantize_rows(out)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    # the kernel wrote unrounded codes (float32: the interpreter has no fp8 stores); round them as the GPU does
    torch.testing.assert_close(q.to(torch.float8_e4m3fn).float(), ref_q.float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_matches_the_unfused_norm_and_quantization(dtype, with_residual):
    from tokenmill.layers.quantization.triton_fp8_fused import rms_norm_quant
    from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 96, generator=g) * 3).to(dtype)
    x[2, 7] = 40.0  # one outlier sets its row's scale
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    res = torch.randn(5, 96, generator=g) if with_residual else None  # the float32 stream
    if with_residual:
        ref, ref_res = fused_add_rms_norm(x, res.clone(), w, 1e-5)
        res_in = res.clone()
        out = rms_norm_quant(x, res_in, w, 1e-5, dtype, code_dtype=torch.float32)
        torch.testing.assert_close(res_in, ref_res, rtol=0, atol=0)
    else:
        ref = rms_norm(x, w, 1e-5)
        out = rms_norm_quant(x, None, w, 1e-5, dtype, code_dtype=torch.float32)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    _codes_match(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [96, 100])  # a power of two's row and a masked one
def test_silu_and_mul_quant_matches_the_unfused_kernel_and_quantization(dtype, d):
    from tokenmill.layers.quantization.triton_fp8_fused import silu_and_mul_quant
    from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 2 * d, generator=g) * 3).to(dtype)
    x[3, d + 5] = 60.0  # an outlier in up sets its row's scale
    x[4] = 0.0  # an all-zero row: the scale floor, codes 0
    out = silu_and_mul_quant(x, code_dtype=torch.float32)
    torch.testing.assert_close(out, silu_and_mul(x), rtol=0, atol=0)
    _codes_match(out)


def test_attached_codes_belong_to_that_tensor_only():
    x = torch.randn(4, 8)
    fp8_ops.attach(x, torch.zeros(4, 8), torch.ones(4, 1))
    assert fp8_ops.attached(x) is not None
    assert fp8_ops.attached(x.view(4, 8)) is None and fp8_ops.attached(x.clone()) is None


def test_fp8_marks_the_producers_of_its_w8a8_inputs():
    """In a Llama model whose linears are W8A8 with row-wise _scaled_mm: each layer's two norms
    and its SiLU-and-mul; the final norm (it feeds the unquantized LM head) stays unmarked."""
    from torch import nn

    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.norm import RMSNorm
    from tokenmill.layers.quantization.fp8 import Fp8LinearMethod, mark_fused_producers

    def w8a8(n, k):
        lin = Linear(k, n, bias=False)
        lin.quant_method = Fp8LinearMethod(online=True)
        lin.use_scaled_mm = True  # (what process_weights_after_loading finds on a CUDA fp8 device)
        return lin

    layer = nn.Module()
    layer.input_layernorm, layer.post_attention_layernorm = RMSNorm(8), RMSNorm(8)
    layer.self_attn, layer.mlp = nn.Module(), nn.Module()
    layer.self_attn.qkv_proj, layer.self_attn.o_proj = w8a8(16, 8), w8a8(8, 8)
    layer.mlp.gate_up_proj, layer.mlp.down_proj, layer.mlp.act = w8a8(32, 8), w8a8(8, 16), SiluAndMul()
    model = nn.Module()
    model.layers, model.norm = nn.ModuleList([layer]), RMSNorm(8)
    assert mark_fused_producers(model) == 3
    assert layer.input_layernorm.fp8_out and layer.post_attention_layernorm.fp8_out and layer.mlp.act.fp8_out
    assert not model.norm.fp8_out
    other = RMSNorm(8)  # the class default stays off
    assert not other.fp8_out
    layer.mlp.gate_up_proj.use_scaled_mm = False  # a weight _scaled_mm refuses: it quantizes nothing per token
    layer.post_attention_layernorm = RMSNorm(8)
    assert mark_fused_producers(model) == 2 and not layer.post_attention_layernorm.fp8_out


def test_codes_only_producers_write_the_same_codes():
    """write_out=False (codes for a consumer that reads them alone): the same codes and scales as
    the full kernels, and the residual still updated."""
    from tokenmill.layers.quantization.triton_fp8_fused import rms_norm_quant, silu_and_mul_quant

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 200, generator=g) * 3).half()  # (fp16: the output's rounding is in the codes)
    full, part = silu_and_mul_quant(x, torch.float32), silu_and_mul_quant(x, torch.float32, write_out=False)
    for a, b in zip(fp8_ops.attached(full), fp8_ops.attached(part)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    h, w = torch.randn(5, 96, generator=g).half(), (torch.rand(96, generator=g) + 0.5).half()
    res_a = torch.randn(5, 96, generator=g)
    res_b = res_a.clone()
    full = rms_norm_quant(h, res_a, w, 1e-5, torch.float16, code_dtype=torch.float32)
    part = rms_norm_quant(h, res_b, w, 1e-5, torch.float16, code_dtype=torch.float32, write_out=False)
    torch.testing.assert_close(res_a, res_b, rtol=0, atol=0)
    for a, b in zip(fp8_ops.attached(full), fp8_ops.attached(part)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _StubSlots:
    """Stands for attached LoRA slots: a linear's `lora` setter binds through `with_lora`, which
    reads the slots' per-step batch."""

    batch = SimpleNamespace(active=False)


def test_silu_writes_codes_only_where_down_proj_is_its_one_reader():
    """`fp8.codes_only`: only a SiLU-and-mul whose MLP declares down_proj its one reader
    (LlamaMLP's own forward; not a subclass with another), and only while down_proj has no LoRA."""
    from torch import nn

    from tokenmill.config import ModelArch
    from tokenmill.distributed.parallel_state import ParallelContext
    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quantization.fp8 import Fp8LinearMethod, codes_only, mark_fused_producers
    from tokenmill.model.llama import LlamaMLP

    def w8a8(n, k):
        lin = Linear(k, n, bias=False)
        lin.quant_method = Fp8LinearMethod(online=True)
        lin.use_scaled_mm = True
        return lin

    def model_with(mlp_flag):
        layer = nn.Module()
        layer.mlp = nn.Module()
        layer.mlp.gate_up_proj, layer.mlp.down_proj, layer.mlp.act = w8a8(32, 8), w8a8(8, 16), SiluAndMul()
        if mlp_flag is not None:
            layer.mlp.act_feeds_only_down = mlp_flag
        mark_fused_producers(layer)
        return layer.mlp

    assert not codes_only(model_with(None).act) and not codes_only(model_with(False).act)
    mlp = model_with(True)
    assert mlp.act.fp8_out and codes_only(mlp.act)
    mlp.down_proj.lora = _StubSlots()  # LoRA slots on down_proj read the bf16 product
    assert not codes_only(mlp.act)
    arch = ModelArch(architecture="LlamaForCausalLM", model_type="llama", vocab_size=64, hidden_size=8,
                     intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4,
                     rms_norm_eps=1e-5, max_position=64)
    parallel = ParallelContext.single(arch)
    assert LlamaMLP(arch, parallel).act_feeds_only_down

    class OtherMLP(LlamaMLP):
        def forward(self, x, residual=None, lora_into=None):  # another reader could see the product
            return super().forward(x, residual, lora_into)
    assert not OtherMLP(arch, parallel).act_feeds_only_down


def test_norms_write_codes_only_where_the_decoder_layer_says_so():
    """`fp8.codes_only` for a decoder layer's two RMSNorms: only where the layer declares each
    norm's linear its one reader (LlamaDecoderLayer with its own forwards and LlamaAttention's /
    LlamaMLP's; not a subclass with another forward), and only while that linear has no LoRA."""
    from torch import nn

    from tokenmill.config import ModelArch
    from tokenmill.distributed.parallel_state import ParallelContext
    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.norm import RMSNorm
    from tokenmill.layers.quantization.fp8 import Fp8LinearMethod, codes_only, mark_fused_producers
    from tokenmill.model.llama import LlamaDecoderLayer

    def w8a8(n, k):
        lin = Linear(k, n, bias=False)
        lin.quant_method = Fp8LinearMethod(online=True)
        lin.use_scaled_mm = True
        return lin

    def layer_with(flag):
        layer = nn.Module()
        layer.input_layernorm, layer.post_attention_layernorm = RMSNorm(8), RMSNorm(8)
        layer.self_attn, layer.mlp = nn.Module(), nn.Module()
        layer.self_attn.qkv_proj, layer.self_attn.o_proj = w8a8(16, 8), w8a8(8, 8)
        layer.mlp.gate_up_proj, layer.mlp.down_proj, layer.mlp.act = w8a8(32, 8), w8a8(8, 16), SiluAndMul()
        if flag is not None:
            layer.norms_feed_only_linears = flag
        mark_fused_producers(layer)
        return layer

    for flag in (None, False):
        layer = layer_with(flag)
        assert layer.input_layernorm.fp8_out and not codes_only(layer.input_layernorm)
        assert not codes_only(layer.post_attention_layernorm)
    layer = layer_with(True)
    assert codes_only(layer.input_layernorm) and codes_only(layer.post_attention_layernorm)
    layer.self_attn.qkv_proj.lora = _StubSlots()  # LoRA on qkv_proj reads the bf16 norm output
    assert not codes_only(layer.input_layernorm) and codes_only(layer.post_attention_layernorm)

    arch = ModelArch(architecture="LlamaForCausalLM", model_type="llama", vocab_size=64, hidden_size=8,
                     intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4,
                     rms_norm_eps=1e-5, max_position=64)
    parallel = ParallelContext.single(arch)
    assert LlamaDecoderLayer(arch, TorchRefAttentionBackend, parallel).norms_feed_only_linears

    class OtherLayer(LlamaDecoderLayer):
        def forward_mlp(self, hidden, residual):  # another reader could see the norm's output
            return super().forward_mlp(hidden, residual)
    assert not OtherLayer(arch, TorchRefAttentionBackend, parallel).norms_feed_only_linears
