"""INT4 GEMVs with a Llama layer's RMSNorm and residual add folded in (`triton_int4_mma`'s NORM and
RES, `quantization.int4_norm_fold`) under TRITON_INTERPRET=1 against the unfused path
(`triton_ops.rms_norm` then the GEMV: equal up to the float32 order of the rms's sum; the GEMV
then a float32 add: bit for bit), in float32 and float16,
at 1..8 rows, one slice and split-K, with and without the SiLU epilogue. The inline PTX runs on
a GPU only (`int4_norm_fold.selftest`, `scripts/gpu_int4_b1.py`)."""

from __future__ import annotations

import os
from typing import NamedTuple

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers.requirements import require_module
from tokenmill.layers.quantization import int4_packing as packing

require_module("triton")


def _case(n=128, k=256, group=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = packing.quantize_int4(torch.randn(n, k, generator=g), group, sym=False)
    codes.scales = codes.scales.half().float()
    return packing.from_codes(codes, torch.float32, act_order=False)


def _operands(wt, dtype, silu=False):
    """`wt`'s GEMV operands: words in the mma layout, scales and zeros in `dtype`; with `silu` its
    channels in `gate_up_pairs` order (what the SiLU epilogue reads)."""
    perm = packing.gate_up_pairs(wt.qweight.shape[1]) if silu else slice(None)
    return packing.to_mma(wt.qweight[:, perm]), wt.scales[:, perm].to(dtype), wt.zeros[:, perm].to(dtype)


class AddThenNorm(NamedTuple):
    """An add GEMV ([K, K] weight: x -> the stream) and the next GEMV ([K, 128] weight) that reads
    the stream normalized by weight `w`; each weight as `_operands`."""

    add: tuple
    norm: tuple
    x: torch.Tensor
    stream: torch.Tensor
    w: torch.Tensor
    counters: torch.Tensor


@pytest.fixture
def add_then_norm():
    """make(m, dtype, seeds=(add weight, next weight, inputs), silu) -> AddThenNorm, K = 256."""
    def make(m, dtype, seeds, silu=False):
        k = 256
        add_w, nxt = _case(n=k, k=k, seed=seeds[0]), _case(n=128, k=k, seed=seeds[1])
        g = torch.Generator().manual_seed(seeds[2])
        x = torch.randn(m, k, generator=g).to(dtype)
        stream = torch.randn(m, k, generator=g) * 2
        w = (torch.rand(k, generator=g) + 0.5).to(dtype)
        return AddThenNorm(_operands(add_w, dtype), _operands(nxt, dtype, silu), x, stream, w,
                           torch.zeros(16, dtype=torch.int32))
    return make


# Each launch shape in one dtype (both dtypes with and without SiLU, and both for the cheapest shape):
# the dtype changes the loads' conversions and the tolerance, the same for every shape. The full cross
# product took twice the interpreter's time (28 s).
@pytest.mark.parametrize("m,group,warps,split,silu,dtype", [
    (1, 64, 1, 1, False, torch.float32), (3, 128, 4, 2, False, torch.float32), (3, 128, 4, 2, False, torch.float16),
    (8, 64, 2, 4, False, torch.float16), (1, 64, 2, 2, True, torch.float32), (5, 128, 1, 1, True, torch.float16)])
def test_folded_norm_equals_the_norm_kernel_then_the_gemv(m, group, warps, split, silu, dtype):
    from tokenmill.layers.quantization.triton_int4_mma import MmaGemv, mma_gemv
    from tokenmill.layers.triton_ops.rms_norm import rms_norm

    n, k = 128, 256
    qm, s, z = _operands(_case(n, k, group), dtype, silu)
    g = torch.Generator().manual_seed(2)
    stream = torch.randn(m, k, generator=g) * 3
    w = (torch.rand(k, generator=g) + 0.5).to(dtype)
    counters = torch.zeros(8, dtype=torch.int32)
    c = MmaGemv(warps, split)
    ref = mma_gemv(rms_norm(stream, w, 1e-5, dtype), qm, s, z, group, c, counters, silu=silu)
    before = stream.clone()
    for _ in range(2):  # a second call reuses the counters
        out = mma_gemv(stream, qm, s, z, group, c, counters, silu=silu, norm=(w, 1e-5))
        assert out.dtype == dtype and out.shape == ref.shape
        _close_to_unfused(out, ref, dtype)
        assert not counters.any()
    assert torch.equal(stream, before), "the folded norm reads the stream, never writes it"
    # the check can fail: another norm weight is another product
    with pytest.raises(AssertionError):
        _close_to_unfused(mma_gemv(stream, qm, s, z, group, c, counters, silu=silu, norm=(w * 1.01, 1e-5)), ref, dtype)


def _close_to_unfused(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """The folded norm sums the squares in another float32 order than the norm kernel (rstd may
    differ in its last bit): float32 within a few ulps; float16 bit for bit but for rare roundings."""
    err = (out.double() - ref.double()).abs().max().item() / ref.double().abs().max().item()
    if dtype == torch.float32:
        assert err < 1e-6, err
    else:
        assert err < 2e-3 and (out == ref).double().mean().item() > 0.95, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,warps,split", [(1, 1, 2), (4, 2, 4), (8, 4, 2)])
def test_folded_add_equals_the_gemv_then_a_float32_add(m, warps, split, dtype):
    from tokenmill.layers.quantization.triton_int4_mma import MmaGemv, mma_gemv

    qm, s, z = _operands(_case(), dtype)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, 256, generator=g).to(dtype)
    res = torch.randn(m, 128, generator=g)
    counters = torch.zeros(8, dtype=torch.int32)
    c = MmaGemv(warps, split)
    ref = res + mma_gemv(x, qm, s, z, 64, c, counters).float()  # the GEMV's result rounded, then added
    stream = res.clone()
    assert mma_gemv(x, qm, s, z, 64, c, counters, add_to=stream) is stream
    assert torch.equal(stream, ref) and not counters.any()
    assert not torch.equal(res + mma_gemv(x, qm, s, z, 64, c, counters).double().float() * 1.001, ref)


def test_fold_refuses_what_it_cannot_take():
    from tokenmill.layers.quantization.triton_int4_mma import MmaGemv, mma_gemv

    wt = _case()
    qm = packing.to_mma(wt.qweight)
    counters = torch.zeros(8, dtype=torch.int32)
    x = torch.randn(1, 256)
    with pytest.raises(ValueError, match="split-K"):  # the add runs in the split-K epilogue only
        mma_gemv(x, qm, wt.scales, wt.zeros, 64, MmaGemv(1, 1), counters, add_to=torch.zeros(1, 128))
    with pytest.raises(ValueError, match="float32 stream"):
        mma_gemv(x.half(), qm, wt.scales, wt.zeros, 64, MmaGemv(1, 1), counters, norm=(torch.ones(256), 1e-5))
    with pytest.raises(ValueError, match="contiguous float32"):
        mma_gemv(x, qm, wt.scales, wt.zeros, 64, MmaGemv(1, 2), counters, add_to=torch.zeros(1, 128).half())


def test_fold_switch(monkeypatch):
    from tokenmill.layers.quantization import int4_norm_fold as fold

    for value, mode in (("0", "off"), ("1", "scale"), ("scale", "scale"), ("prologue", "prologue"), ("row", "row")):
        monkeypatch.setenv(fold.ENV_VAR, value)
        assert fold.mode() == mode and fold.enabled() == (mode != "off") and fold.partial_sums() == (mode != "row")
    monkeypatch.setenv(fold.ENV_VAR, "yes")
    with pytest.raises(ValueError, match="expected one of"):
        fold.mode()


@pytest.mark.parametrize("m,warps,dtype", [(1, 1, torch.float32), (3, 2, torch.float16), (8, 4, torch.float32),
                                           (8, 4, torch.float16)])  # (each shape in one dtype at least)
def test_adds_hand_the_norm_their_sums_of_squares(m, warps, dtype, add_then_norm):
    """RES with sumsq: each channel block's sums of squares of the new stream's rows; the folded
    norm from them equals the norm kernel then the GEMV (up to the float32 order of the sum: close,
    and bit for bit where that order does not change the rounding)."""
    from tokenmill.layers.quantization.triton_int4_mma import MmaGemv, mma_gemv
    from tokenmill.layers.triton_ops.rms_norm import rms_norm

    k = 256
    (aq, a_s, a_z), (nq, n_s, n_z), x, stream, w, counters = add_then_norm(m, dtype, seeds=(5, 6, 7))
    c = MmaGemv(warps, 2)
    parts = k // (16 * warps)
    sumsq = torch.full((m, parts), float("nan"))
    mma_gemv(x, aq, a_s, a_z, 64, c, counters, add_to=stream, sumsq=sumsq)
    whole = stream.double().square().sum(1)
    assert torch.allclose(sumsq.double().sum(1), whole, rtol=1e-6)
    blocks = stream.double().square().view(m, parts, 16 * warps).sum(2)
    assert torch.allclose(sumsq.double(), blocks, rtol=1e-6), "column b: channel block b's share"
    ref = mma_gemv(rms_norm(stream, w, 1e-5, dtype), nq, n_s, n_z, 64, MmaGemv(1, 2), counters)
    out = mma_gemv(stream, nq, n_s, n_z, 64, MmaGemv(1, 2), counters, norm=(w, 1e-5), sumsq=sumsq)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert (out.double() - ref.double()).abs().max().item() <= tol * ref.double().abs().max().item()
    # the check can fail: the sums of another stream give another norm
    wrong = mma_gemv(stream, nq, n_s, n_z, 64, MmaGemv(1, 2), counters, norm=(w, 1e-5), sumsq=sumsq * 1.5)
    assert (wrong.double() - ref.double()).abs().max().item() > 10 * tol * ref.double().abs().max().item()
    assert not counters.any()


def test_what_an_add_made_rides_on_the_stream_between_layers():
    from tokenmill.layers.quantization import int4_norm_fold as fold

    stream, carry = torch.zeros(1, 4), fold.Carry(torch.ones(1, 2), None, None)
    assert fold.take_carry(stream) is None
    fold.keep_carry(stream, carry)
    assert fold.take_carry(stream) is carry and fold.take_carry(stream) is None, "taken once"


@pytest.mark.parametrize("mode", ["prologue", "scale"])
def test_a_folded_llama_layer_equals_its_unfused_steps(monkeypatch, mode):
    """`LlamaDecoderLayer._forward_folded` (attention stubbed) against the same steps unfused: the
    norm kernels, the GEMVs, float32 adds; twice, the second layer reading what the first one's
    last add made off the stream it returned (scale: y for its norm, set as the next layer's)."""
    from tokenmill.layers.quantization import int4_norm_fold as fold

    monkeypatch.setenv(fold.ENV_VAR, mode)
    from types import SimpleNamespace

    from tokenmill.config import ModelArch
    from tokenmill.distributed.parallel_state import ParallelContext
    from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend
    from tokenmill.layers.quantization import int4
    from tokenmill.layers.quantization.triton_int4_mma import mma_gemv
    from tokenmill.layers.triton_ops.rms_norm import rms_norm
    from tokenmill.model.llama import LlamaDecoderLayer

    dt, group, hidden, inter = torch.float16, 64, 256, 128
    arch = ModelArch(architecture="LlamaForCausalLM", model_type="llama", vocab_size=64, hidden_size=hidden,
                     intermediate_size=inter, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64,
                     rms_norm_eps=1e-5, max_position=64)
    layer = LlamaDecoderLayer(arch, TorchRefAttentionBackend, ParallelContext.single(arch))
    attn, mlp = layer.self_attn, layer.mlp
    weights = {}
    for seed, (name, lin) in enumerate((("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                                        ("down", mlp.down_proj))):
        wt = _case(lin.out_features, lin.in_features, group, seed=10 + seed)
        wt = packing.Int4Weights(packing.to_mma(wt.qweight), wt.scales.to(dt), wt.zeros.to(dt), None)
        if name == "gate_up":
            wt, _ = int4.pair_gate_up(wt)
        weights[name] = wt
        # (the attributes the fold reads, set on the module without the loader)
        object.__setattr__(lin, "qweight", wt.qweight)
        object.__setattr__(lin, "scales", wt.scales)
        object.__setattr__(lin, "zeros", wt.zeros)
        lin.stream_counters = SimpleNamespace(tensor=torch.zeros(64, dtype=torch.int32))
        lin.quant_method = SimpleNamespace(config=SimpleNamespace(group_size=group))
    g = torch.Generator().manual_seed(11)
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight.data = (torch.rand(hidden, generator=g) + 0.5).to(dt)
    attn.attend = lambda qkv, rope, kv_cache, meta, act_dtype: (qkv[:, :hidden] * 0.5).contiguous()
    object.__setattr__(layer, "_next_input_norm", layer.input_layernorm)  # (the layer runs twice: its own next)

    def unfused(stream):
        def gemv(name, x, **kw):
            w = weights[name]
            return mma_gemv(x, w.qweight, w.scales, w.zeros, group, counters=torch.zeros(64, dtype=torch.int32), **kw)
        qkv = gemv("qkv", rms_norm(stream, layer.input_layernorm.weight, 1e-5, dt))
        stream = stream + gemv("o", (qkv[:, :hidden] * 0.5).contiguous()).float()
        act = gemv("gate_up", rms_norm(stream, layer.post_attention_layernorm.weight, 1e-5, dt), silu=True)
        return stream + gemv("down", act).float()

    x = torch.randn(3, hidden, generator=g).to(dt)
    residual = torch.randn(3, hidden, generator=g) * 2
    ref = unfused(residual + x.float())
    out, none = layer._forward_folded(x, residual.clone(), None, None, None)
    assert none is None and out.dtype == torch.float32
    _layer_close(out, ref, mode)
    carry = out.__dict__["_int4_fold_carry"]
    assert carry.sumsq.shape == (3, hidden // 64)  # down's channel blocks (4 warps)
    assert (carry.y is not None) == (mode == "scale")
    ref2 = unfused(out.clone())
    out2, _ = layer._forward_folded(out, None, None, None, None)
    assert out2 is out, "the stream is updated in place"
    _layer_close(out2, ref2, mode)


def _layer_close(out: torch.Tensor, ref: torch.Tensor, mode: str) -> None:
    """prologue: the norm kernel's roundings (the sum's order aside); scale: the normalized input
    rounded once instead of twice, which float16 GEMVs of these random weights (outputs ~1e3)
    carry into the stream at its rounding's size."""
    if mode == "prologue":
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    else:
        assert ((out - ref).norm() / ref.norm()).item() < 2e-3, ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("m,warps,silu,dtype", [(1, 1, False, torch.float16), (3, 2, True, torch.float32),
                                                (3, 2, True, torch.float16), (8, 4, False, torch.float32)])
def test_rstd_after_the_gemv_of_the_weighted_stream(m, warps, silu, dtype, add_then_norm):
    """`weighted` + `rstd_of` (the kernel's YW and RSTD): the add writes y = stream * weight (rounded)
    beside the sums of squares, and the next GEMV of y scales each row by its rstd in the split-K
    epilogue: the norm kernel then the GEMV, but for one rounding of the normalized input less."""
    from tokenmill.layers.quantization.triton_int4_mma import MmaGemv, mma_gemv
    from tokenmill.layers.triton_ops.rms_norm import rms_norm

    k = 256
    (aq, a_s, a_z), (nq, n_s, n_z), x, stream, w, counters = add_then_norm(m, dtype, seeds=(8, 9, 12), silu=silu)
    parts = k // (16 * warps)
    sumsq, y = torch.empty(m, parts), torch.full((m, k), float("nan")).to(dtype)
    mma_gemv(x, aq, a_s, a_z, 64, MmaGemv(warps, 2), counters, add_to=stream, sumsq=sumsq, weighted=(y, w))
    assert torch.equal(y, (stream * w.float()).to(dtype))
    c = MmaGemv(1, 2)
    ref = mma_gemv(rms_norm(stream, w, 1e-5, dtype), nq, n_s, n_z, 64, c, counters, silu=silu)
    out = mma_gemv(y, nq, n_s, n_z, 64, c, counters, silu=silu, rstd_of=(sumsq, 1e-5))
    err = (out.double() - ref.double()).abs().max().item() / ref.double().abs().max().item()
    assert err < (1e-6 if dtype == torch.float32 else 4e-3), err
    wrong = mma_gemv(y, nq, n_s, n_z, 64, c, counters, silu=silu, rstd_of=(sumsq * 1.1, 1e-5))
    assert (wrong.double() - ref.double()).abs().max().item() / ref.double().abs().max().item() > 10 * err
    assert not counters.any()
    with pytest.raises(ValueError, match="split-K"):
        mma_gemv(y, nq, n_s, n_z, 64, MmaGemv(1, 1), counters, rstd_of=(sumsq, 1e-5))


def test_selftest_passes_and_falls_back(monkeypatch, caplog):
    """The fold's device self-test passes on the interpreter (float16); a GEMV that drops the rstd
    fails it, logged (layers then run their norms apart). N = 64 instead of 256 for the interpreter's
    time (K and the group stay: the pipelined loop takes groups of 128, split 8 needs 8 of them)."""
    from tokenmill.layers.quantization import int4_norm_fold as fold
    from tokenmill.layers.quantization import triton_int4_mma as mma

    shape = (64, 1024, 128)
    monkeypatch.setattr(fold, "_SELFTEST", {})
    assert fold.selftest(torch.device("cpu"), torch.float16, shape)
    monkeypatch.setattr(fold, "_SELFTEST", {})
    real = mma.mma_gemv
    monkeypatch.setattr(mma, "mma_gemv", lambda *a, rstd_of=None, **kw: real(*a, **kw))
    assert not fold.selftest(torch.device("cpu"), torch.float16, shape) and "failed their self-test" in caplog.text
