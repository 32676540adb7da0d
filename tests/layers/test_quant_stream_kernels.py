"""The small-batch quantized GEMM kernels under TRITON_INTERPRET=1 against torch references:
the fp8 weight-streaming kernel (channel and block scales, bf16-style activations unquantized)
and the INT4 kernel (GEMV rows, tensor-core tiles), with and without split-K; float32 and
float16 activations; the split-K counters come back zeroed (graph replays rely on it).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers.requirements import require_module
from tokenmill.layers.quantization import fp8_ops
from tokenmill.layers.quantization import int4_packing as packing
from tokenmill.layers.quantization.stream_tiles import Tiles

require_module("triton")  # skipped on a machine without it; in CI, missing fails

FP8_TILES = [Tiles(1, 16, 32, 1), Tiles(1, 16, 32, 3), Tiles(1, 16, 32, 2, flat=False), Tiles(16, 16, 32, 2),
             Tiles(1, 16, 32, 2, pipe=True), Tiles(16, 16, 32, 1, stages=2, pipe=True),
             # more weight tiles loaded before the PDL wait (with more than, and fewer than, the slice's tiles)
             Tiles(1, 16, 32, 1, pipe=True, pre=3), Tiles(1, 16, 32, 3, pipe=True, pre=4), Tiles(1, 16, 64, 2, pre=2)]


def _fp8_weight(n, k, block, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    if block is None:
        q, s = fp8_ops.quantize_rows(w)
    else:
        q, s = fp8_ops.quantize_blocks(w, block)
    return w, q.float(), s  # the interpreter computes on float32 holding the fp8 values


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("block,dtype", [(None, torch.float32), ((32, 64), torch.float32), (None, torch.float16)])
def test_fp8_stream_matches_reference(m, block, dtype):
    from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_gemm, fp8_stream_reference

    w, q, s = _fp8_weight(80, 192, block)
    x = torch.randn(m, 192, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = fp8_stream_reference(x, q, s, block)
    counters = torch.zeros(64, dtype=torch.int32)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for t in FP8_TILES:
        if m > 1 and t.block_m == 1:
            continue
        out = fp8_stream_gemm(x, q, s, block, counters, tiles=t)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol, msg=t.label)
        assert not counters.any(), "split-K counters must be reset for the next call"
    # the default tiles, no counters (no split)
    torch.testing.assert_close(fp8_stream_gemm(x, q, s, block).double(), ref, atol=tol, rtol=tol)
    assert (x.double() @ w.double().t() - ref).abs().max() > 1e-3  # the weight really is quantized


# GEMV rows; small tiles (16 + q, zero points through x's row sums); >= 64-row tiles (dequantized
# in registers): with 8 nibble dots (BLOCK_K >= 128) or one dot after a reshape
INT4_TILES = [Tiles(1, 32, 32, 1), Tiles(1, 32, 64, 2), Tiles(16, 32, 32, 3), Tiles(32, 64, 64, 1),
              Tiles(16, 32, 128, 2), Tiles(32, 32, 128, 1, nibble_dots=False), Tiles(64, 32, 64),
              Tiles(64, 32, 128)]


def _int4_case(n=96, k=256, group=64, sym=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    codes = packing.quantize_int4(w, group, sym)
    codes.scales = codes.scales.half().float()
    return w, packing.from_codes(codes, torch.float32, act_order=False)


@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("group,dtype", [(64, torch.float32), (128, torch.float32), (-1, torch.float32),
                                         (128, torch.float16)])
def test_int4_stream_matches_reference(m, group, dtype):
    from tokenmill.layers.quantization.triton_int4_stream import int4_stream_gemm

    w, wt = _int4_case(group=group)
    x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = x.double() @ packing.dequantize(wt, group, torch.float64)
    scales, zeros = wt.scales.to(dtype), wt.zeros.to(dtype)
    counters = torch.zeros(64, dtype=torch.int32)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    for t in INT4_TILES:
        if (m > 1 and t.block_m == 1) or (group > 0 and group % t.block_k):
            continue
        out = int4_stream_gemm(x, wt.qweight, scales, zeros, group, counters, tiles=t)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol, msg=t.label)
        assert not counters.any(), "split-K counters must be reset for the next call"
    torch.testing.assert_close(int4_stream_gemm(x, wt.qweight, scales, zeros, group).double(), ref,
                               atol=tol, rtol=tol)
    assert (x.double() @ w.double().t() - ref).abs().max() > 1e-2


def test_int4_stream_refuses_a_tile_straddling_groups():
    from tokenmill.layers.quantization.triton_int4_stream import int4_stream_gemm

    _, wt = _int4_case(group=32)
    with pytest.raises(ValueError, match="group size 32"):
        int4_stream_gemm(torch.randn(1, 256), wt.qweight, wt.scales, wt.zeros, 32, tiles=Tiles(1, 32, 64))


def test_int4_matmul_routes_by_act_order_and_group(monkeypatch):
    """Plain groups take the streaming kernel (with the layer's counters); act-order and groups
    that are no multiple of 16 take the per-channel-group kernel."""
    from tokenmill.layers.quantization import triton_int4, triton_int4_stream

    calls = []
    monkeypatch.setattr(triton_int4_stream, "int4_stream_gemm", lambda *a: calls.append("stream") or "s")
    monkeypatch.setattr(triton_int4, "int4_gemm", lambda *a, **k: calls.append("fused") or "f")
    _, wt = _int4_case(group=64)
    counters = torch.zeros(8, dtype=torch.int32)
    x = torch.randn(3, 256)
    triton_int4.int4_matmul(x, wt.qweight, wt.scales, wt.zeros, None, 64, counters)
    triton_int4.int4_matmul(x, wt.qweight, wt.scales, wt.zeros, torch.zeros(256, dtype=torch.int32), 64, counters)
    triton_int4.int4_matmul(x, wt.qweight, wt.scales, wt.zeros, None, 8, counters)
    assert calls == ["stream", "fused", "fused"]


def test_tile_tables(monkeypatch):
    """Labels parse back; a measured (kind, bucket, N, K) entry wins over the bucket's default; a
    group its K tile does not divide falls back to the default with a fitting K tile."""
    from tokenmill.layers.quantization import stream_tiles as st

    t = Tiles(16, 64, 128, 4, 8, 2, nibble_dots=False, flat=False, pipe=True)
    assert Tiles.parse(t.label()) == t and eval(t.code(), {"Tiles": Tiles}) == t
    monkeypatch.setattr(st, "MEASURED", {("int4", 1, 96, 256): Tiles(1, 32, 64, 2)})
    assert st.int4_tiles(1, 96, 256, 64, 132) == Tiles(1, 32, 64, 2)
    fallback = st.int4_tiles(1, 96, 256, 32, 132)
    assert fallback.block_k == 32 and fallback.block_m == 1
    assert st.int4_tiles(3, 96, 256, 64, 132).block_m == 16  # the 16-row bucket
    assert st.int4_tiles(300, 4096, 4096, 128, 132).block_m >= 64 and st.int4_tiles(300, 4096, 4096, 128, 132).split == 1
    assert st.fp8_tiles(1, 4096, 4096, None, 132).split > 1  # 128 N tiles cannot fill 132 SMs twice
    assert st.fp8_tiles(1, 96, 256, (32, 32), 132).block_k == 32  # inside one scale block


def _silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with `triton_ops.silu_and_mul`'s roundings (silu to x's dtype, then the product)."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate).to(x.dtype).float() * up).to(x.dtype)


@pytest.mark.parametrize("m,dtype", [(1, torch.float32), (3, torch.float32), (1, torch.float16), (5, torch.float16)])
def test_fp8_stream_silu_x_is_silu_and_mul_then_the_gemv(m, dtype):
    """silu_x: the GEMV reads a [gate | up] row pair and multiplies silu(gate) * up in its loads; it
    must equal SiLU-and-mul followed by the plain GEMV (bitwise where the summation is the same)."""
    from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_gemm, fp8_stream_reference
    from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul

    w, q, s = _fp8_weight(48, 128, None)
    x = (torch.randn(m, 256, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)
    act = _silu_mul_reference(x)
    ref = fp8_stream_reference(act, q, s)
    counters = torch.zeros(64, dtype=torch.int32)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for t in FP8_TILES:
        if m > 1 and t.block_m == 1:
            continue
        fused = fp8_stream_gemm(x, q, s, None, counters, tiles=t, silu_x=True)
        torch.testing.assert_close(fused.double(), ref, atol=tol, rtol=tol, msg=t.label)
        unfused = fp8_stream_gemm(silu_and_mul(x), q, s, None, counters, tiles=t)  # the engine's two kernels
        assert torch.equal(fused, unfused), t.label
        assert not counters.any()
    with pytest.raises(ValueError, match="silu_x"):
        fp8_stream_gemm(x[:, :200], q, s, silu_x=True)


def test_fp8_silu_defers_to_the_streaming_down_proj():
    """The engine's wiring: a marked SiLU-and-mul hands [gate | up] to down_proj's streaming GEMV at
    few rows (no separate kernel), the same result as computing it first; at more rows than the
    GEMV takes, with LoRA on down_proj, or with the switch off it computes the product itself."""
    from torch import nn

    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quantization import fp8, stream_tiles

    _, q, s = _fp8_weight(32, 64, None)
    down = Linear(64, 32, bias=False)
    down.quant_method = fp8.Fp8LinearMethod(online=False)
    down.weight = nn.Parameter(q, requires_grad=False)  # float32 holding fp8 values (the interpreter)
    down.weight_scale = nn.Parameter(s, requires_grad=False)
    down.stream_counters = stream_tiles.SplitCounters(32, torch.device("cpu"))  # (CUDA 8.9+ sets it at load)
    down.use_scaled_mm = False
    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.down_proj, layer.mlp.act = down, SiluAndMul()
    assert fp8.mark_fused_producers(layer) == 1 and layer.mlp.act.fp8_defer
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(3))
    pending = layer.mlp.act(x)
    assert pending.shape == x.shape and getattr(pending, fp8._SILU_PENDING, False)
    from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_gemm
    from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul
    expected = fp8_stream_gemm(silu_and_mul(x), q, s, None, down.stream_counters.tensor)
    assert torch.equal(down(pending), expected)
    many = torch.randn(stream_tiles.FP8_STREAM_MAX_ROWS + 1, 128)
    assert layer.mlp.act(many).shape == (many.shape[0], 64)  # computed here: W8A8 takes that many rows
    down.__dict__["lora"] = object()
    assert layer.mlp.act(x).shape == (2, 64)
    del down.__dict__["lora"]
    fp8.FUSE_SILU_GEMV = False
    try:
        assert layer.mlp.act(x).shape == (2, 64)
    finally:
        fp8.FUSE_SILU_GEMV = True


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_8bit_lm_head_gives_float32_logits_of_the_rounded_head(kind):
    """The opt-in 8-bit LM head (`lm_head_8bit`): float32 logits straight from the streaming GEMV
    (out_dtype, int8 or e4m3 weights), equal to the torch reference of the rounded head;
    `ParallelLMHead.logits` takes them for the rows the copy serves (into a graph's `out` buffer too).
    int8 rounds far closer than e4m3 (uniform steps)."""
    from types import SimpleNamespace

    from tokenmill.layers.parallel_linear import ParallelLMHead
    from tokenmill.layers.quantization import lm_head_8bit
    from tokenmill.layers.quantization.triton_fp8_stream import fp8_stream_reference

    w = torch.randn(200, 64, generator=torch.Generator().manual_seed(4)) * 0.1
    head = lm_head_8bit.quantize_head(w, kind)
    if kind == "int8":
        assert head.weight.dtype == torch.int8 and head.weight.abs().max() <= 127
    else:
        head.weight = head.weight.float()  # the interpreter computes on float32 holding the fp8 values
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(5)).half()
    logits = head.logits(x)
    assert logits.dtype == torch.float32 and logits.shape == (1, 200)
    torch.testing.assert_close(logits.double(), fp8_stream_reference(x, head.weight, head.scale), atol=1e-4, rtol=1e-4)
    exact = x.double() @ w.double().t()
    err = (logits.double() - exact).abs().max()
    assert err > 1e-5  # the head really is rounded
    other = lm_head_8bit.quantize_head(w, "fp8" if kind == "int8" else "int8")
    if kind == "int8":  # ... and int8 closer than e4m3
        assert err < 0.5 * (fp8_stream_reference(x, other.weight.float(), other.scale) - exact).abs().max()

    class Taking(lm_head_8bit.Head8Bit):
        def takes(self, hidden):  # (the real one wants CUDA)
            return True

    lm = ParallelLMHead(SimpleNamespace(tp_size=1, layout=SimpleNamespace(vocab_size=200)))
    lm.head_8bit = Taking(head.weight, head.scale, head.counters)
    out = torch.empty(1, 200)
    assert lm.logits(x, w.half(), out) is out
    assert torch.equal(out, logits)


def test_8bit_lm_head_kind_is_checked(monkeypatch):
    from tokenmill.layers.quantization import lm_head_8bit

    monkeypatch.setenv(lm_head_8bit.ENV_VAR, "int4")
    with pytest.raises(ValueError, match="TOKENMILL_LM_HEAD_8BIT.*int8, fp8"):
        lm_head_8bit.wanted()
    monkeypatch.setenv(lm_head_8bit.ENV_VAR, "off")
    assert lm_head_8bit.wanted() is None
    monkeypatch.delenv(lm_head_8bit.ENV_VAR)
    assert lm_head_8bit.wanted() == "int8"  # the default (SmolLM2's NLL: within noise of the bf16 head)
    monkeypatch.setenv(lm_head_8bit.ENV_VAR, "INT8")
    assert lm_head_8bit.wanted() == "int8"
