"""INT4 x written in the swapped GEMM's K order by its producers (`quantization.int4_kperm`): the
RMSNorm and SiLU-and-mul kernels with KPERM under Triton's CPU interpreter (float32 / float16)
against `permute_x` of their natural output, the inverse permute, the routing (a permuted x goes
to the swapped GEMM as it is, anywhere else back in natural order: the same product), and which
producers `wanted` lets permute. The swapped GEMM itself: tests/layers/test_int4_swap_gemm.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the first import

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.helpers.requirements import require_module
from tokenmill.layers.quantization import int4_kperm
from tokenmill.layers.quantization import int4_packing as packing

require_module("triton")  # skipped on a machine without it; in CI, missing fails


def _permute(x):
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import permute_x

    return permute_x(x)  # (on the CPU: the view permute, the reference)


def test_unpermute_inverts_permute_x():
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import permute_x

    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(0))
    assert torch.equal(int4_kperm.unpermute(permute_x(x)), x)
    assert not torch.equal(permute_x(x), x)  # (not the identity)


def test_kperm_src_is_the_gathered_columns():
    """The kernels' column map (`triton_x_permute.kperm_src`) is the swapped GEMM's K order."""
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import gather_columns
    from tokenmill.layers.quantization.triton_x_permute import kperm_dst, kperm_src

    cols = torch.arange(256)
    assert torch.equal(kperm_src.fn(cols), gather_columns(256))
    assert torch.equal(kperm_src.fn(kperm_dst.fn(cols)), cols)  # the attention kernels' store map: the inverse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_writes_the_k_order(dtype, residual):
    """KPERM: the normed output is `permute_x` of the natural one, bit for bit (only its store moves);
    the residual stream is updated in its natural order."""
    from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 256, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(256, generator=g)).to(dtype)
    if residual:
        res = torch.randn(5, 256, generator=g)
        res2 = res.clone()
        ref, ref_res = fused_add_rms_norm(x, res, w, 1e-6)
        out, out_res = fused_add_rms_norm(x, res2, w, 1e-6, kperm=True)
        assert torch.equal(out_res, ref_res)
    else:
        ref, out = rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6, kperm=True)
    assert torch.equal(out, _permute(ref)) and not torch.equal(out, ref)


@pytest.mark.parametrize("paired", [False, True])
def test_silu_and_mul_writes_the_k_order(paired):
    from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul

    x = torch.randn(3, 2 * 1152, generator=torch.Generator().manual_seed(2)).half()  # d 1152: two column blocks
    ref = silu_and_mul(x, paired=paired)
    out = silu_and_mul(x, paired=paired, kperm=True)
    assert torch.equal(out, _permute(ref)) and not torch.equal(out, ref)
    with pytest.raises(ValueError, match="multiple of 64"):
        silu_and_mul(x[:, :96], kperm=True)


def _int4(n=128, k=256, group=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    codes = packing.quantize_int4(torch.randn(n, k, generator=g), group, sym=False)
    wt = packing.from_codes(codes, torch.float16, act_order=False)
    return packing.to_mma(wt.qweight), wt.scales, wt.zeros


@pytest.mark.parametrize("m", [3, 11])
def test_permuted_x_off_the_swap_route_is_put_back(m):
    """Where the rows do not take the swapped GEMM (here: fp16, the GEMV), a permuted x is put back
    first: the product is the natural one, bit for bit."""
    from tokenmill.layers.quantization import triton_int4_mma as mma

    qm, s, z = _int4()
    counters = torch.zeros(16, dtype=torch.int32)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(4)).half()
    ref = mma.mma_matmul(x, qm, s, z, 64, counters)
    assert torch.equal(mma.mma_matmul(_permute(x), qm, s, z, 64, counters, x_kperm=True), ref)
    assert not torch.equal(mma.mma_matmul(_permute(x), qm, s, z, 64, counters), ref)  # (the order matters)


def test_permuted_x_on_the_swap_route_goes_as_it_is(monkeypatch):
    """On the swapped GEMM's route the permuted x reaches it unchanged, flagged; a gathered-x launch
    (xnat) is no such route."""
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot
    from tokenmill.layers.quantization import triton_int4_mma as mma

    qm, s, z = _int4(n=256, k=512)
    t = dot.SwapTiles(256, 8, 4)
    monkeypatch.setattr(dot, "ENABLED", True)
    monkeypatch.setattr(dot, "TABLE", {(256, 256, 512): t, (64, 256, 512): dot.SwapTiles(64, 4, 4, 1, 64, 2, True)})
    seen = {}
    monkeypatch.setattr(dot, "run", lambda x, *a, x_kperm=False, **kw: seen.update(x=x, tiles=a[4], kperm=x_kperm))
    x = torch.randn(200, 512).to(torch.bfloat16)
    assert int4_kperm.swap_route(200, 256, 512, 64, torch.bfloat16)
    mma.mma_matmul(x, qm, s.bfloat16(), z.bfloat16(), 64, None, x_kperm=True)
    assert seen["x"] is x and seen["tiles"] == t and seen["kperm"]
    assert not int4_kperm.swap_route(50, 256, 512, 64, torch.bfloat16)  # xnat
    assert not int4_kperm.swap_route(200, 256, 512, 64, torch.float16)
    assert not int4_kperm.swap_route(8, 256, 512, 64, torch.bfloat16)  # the GEMV's rows


def test_wanted_only_for_a_linked_consumer_on_the_swap_route(monkeypatch):
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot

    monkeypatch.setattr(dot, "ENABLED", True)
    monkeypatch.setattr(dot, "TABLE", {(256, 256, 512): dot.SwapTiles(256, 8, 4)})
    monkeypatch.setattr(int4_kperm, "ENABLED", True)
    consumer = nn.Module()
    consumer.qweight = torch.zeros(16, 8, 32, 4, dtype=torch.int32)  # N 256, K 512
    consumer.quant_method = SimpleNamespace(config=SimpleNamespace(group_size=128))
    consumer.__dict__["lora"] = None
    producer = nn.Module()
    x = SimpleNamespace(is_cuda=True)
    assert not int4_kperm.wanted(producer, x, 200, 512, torch.bfloat16)  # not linked
    import weakref

    producer.__dict__["_int4_kperm_reader"] = weakref.ref(consumer)
    assert int4_kperm.wanted(producer, x, 200, 512, torch.bfloat16)
    assert not int4_kperm.wanted(producer, x, 300, 512, torch.bfloat16)  # 300 rows: not listed
    assert not int4_kperm.wanted(producer, x, 200, 512, torch.float16)
    assert not int4_kperm.wanted(producer, SimpleNamespace(is_cuda=False), 200, 512, torch.bfloat16)
    consumer.__dict__["lora"] = object()  # a LoRA reads x too
    assert not int4_kperm.wanted(producer, x, 200, 512, torch.bfloat16)
    consumer.__dict__["lora"] = None
    monkeypatch.setattr(int4_kperm, "ENABLED", False)  # TOKENMILL_INT4_KPERM=0
    assert not int4_kperm.wanted(producer, x, 200, 512, torch.bfloat16)


def test_mark_is_on_the_object_only():
    x = torch.zeros(2, 64)
    assert int4_kperm.marked(int4_kperm.mark(x, True))
    assert not int4_kperm.marked(x.view(2, 64)) and not int4_kperm.marked(x.clone())
    assert not int4_kperm.marked(int4_kperm.mark(torch.zeros(1), False))


def _layer(norms_only: bool, act_only: bool) -> nn.Module:
    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.norm import RMSNorm

    layer, attn, mlp = nn.Module(), nn.Module(), nn.Module()
    attn.qkv_proj, attn.o_proj = nn.Linear(4, 4), nn.Linear(4, 4)
    mlp.gate_up_proj, mlp.down_proj, mlp.act = nn.Linear(4, 8), nn.Linear(4, 4), SiluAndMul()
    mlp.act_feeds_only_down = act_only
    layer.self_attn, layer.mlp = attn, mlp
    layer.input_layernorm, layer.post_attention_layernorm = RMSNorm(4), RMSNorm(4)
    layer.norms_feed_only_linears = norms_only
    return layer


def test_producers_linked_only_where_the_linear_is_the_one_reader(monkeypatch):
    """`mark_producers` links input_layernorm -> qkv_proj and post_attention_layernorm ->
    gate_up_proj where the layer declares its norms' outputs read by those linears alone, and the
    MLP's SiLU-and-mul -> down_proj where the MLP declares it; never o_proj; only INT4 linears on
    the mma layout (here: every nn.Linear stands for one)."""
    monkeypatch.setattr(int4_kperm, "_int4_mma_linear", lambda layer: isinstance(layer, nn.Linear))
    reader = "_int4_kperm_reader"
    full = _layer(True, True)
    assert int4_kperm.mark_producers(full) == 3
    assert full.input_layernorm.__dict__[reader]() is full.self_attn.qkv_proj
    assert full.post_attention_layernorm.__dict__[reader]() is full.mlp.gate_up_proj
    assert full.mlp.act.__dict__[reader]() is full.mlp.down_proj
    norms = _layer(False, True)
    assert int4_kperm.mark_producers(norms) == 1 and reader not in norms.input_layernorm.__dict__
    act = _layer(True, False)
    assert int4_kperm.mark_producers(act) == 2 and reader not in act.mlp.act.__dict__
    monkeypatch.setattr(int4_kperm, "_int4_mma_linear", lambda layer: False)  # not INT4 on the mma layout
    assert int4_kperm.mark_producers(_layer(True, True)) == 0


@pytest.mark.parametrize("splits", [1, 3])
def test_attention_writes_the_k_order(splits):
    """The Triton attention with kperm (o_proj's input): the output viewed as [T, heads * head_dim]
    is `permute_x` of the natural one, bit for bit (the same sums, stored elsewhere), with and
    without split-KV (its reduce kernel stores the rows then)."""
    import math

    from tests.layers.test_attention import make_case
    from tokenmill.layers.attention.triton_backend import (
        TritonAttentionBackend,
        TritonAttentionConfig,
    )

    case = make_case([150, 0, 40, 97], [1, 3, 1, 5], 16, 4, 2, torch.float16, "cpu", pad_tokens=2, head_dim=128)
    backend = TritonAttentionBackend(4, 2, 128, 1.0 / math.sqrt(128), config=TritonAttentionConfig(kv_splits=splits))
    nat = backend.forward(case.q, case.k, case.v, case.kv_cache.clone(), case.meta)
    out = backend.forward(case.q, case.k, case.v, case.kv_cache.clone(), case.meta, kperm=True)
    t = nat.shape[0]
    assert torch.equal(out.reshape(t, -1), _permute(nat.reshape(t, -1)))
    assert not torch.equal(out, nat)
