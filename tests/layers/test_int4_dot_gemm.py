"""The plain tl.dot INT4 GEMM on the mma layout (`triton_int4_dot_gemm`) under TRITON_INTERPRET=1
against a float64 torch reference (`int4_packing.dequantize` then a matmul): K tiles of one and
two layout steps, row counts that fill and that do not fill a row tile, split-K (counters come
back zeroed), several weight tiles per row sweep, groups of 64 and 128, float32 and float16.
The PTX dequantization (DEQ 2, GPUs only) is checked here by a small emulator of the
instructions it uses, run on random words and scales against the formula; on a GPU
scripts/gpu_int4_gemm.py (INT4_GEMM_SET=dot) checks every timed launch against the reference.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import re

import pytest
import torch

from tests.helpers.requirements import require_module
from tokenmill.layers.quantization import int4_packing as packing

require_module("triton")  # skipped on a machine without it; in CI, missing fails



@pytest.fixture(autouse=True)
def _dot_gemm_enabled(monkeypatch):
    """An earlier test's `int4.gemm_selftest` may have switched the dot GEMM off for the process."""
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot
    monkeypatch.setattr(dot, "ENABLED", True)

def _case(n=64, k=256, group=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = packing.quantize_int4(torch.randn(n, k, generator=g), group, sym=False)
    codes.scales = codes.scales.half().float()  # exact in fp16 too
    return packing.from_codes(codes, torch.float32, act_order=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k,group,tiles", [
    (16, 256, 64, {"block_m": 16, "block_n": 32, "block_k": 64}),
    (21, 256, 128, {"block_m": 16, "block_n": 16, "block_k": 128}),
    (40, 512, 64, {"block_m": 16, "block_n": 32, "block_k": 64, "split": 3}),
    (33, 512, 128, {"block_m": 32, "block_n": 16, "block_k": 128, "group_n": 2, "split": 2}),
])
def test_dot_gemm_matches_reference(m, k, group, tiles, dtype):
    from tokenmill.layers.quantization.triton_int4_dot_gemm import DotTiles, dot_gemm

    wt = _case(k=k, group=group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    ref = x.double() @ packing.dequantize(wt, group, torch.float64)
    qm = packing.to_mma(wt.qweight)
    counters = torch.zeros(32, dtype=torch.int32)
    t = DotTiles(warps=4, stages=1, deq=1, **tiles)
    for _ in range(2):  # a second call reuses the counters
        out = dot_gemm(x, qm, wt.scales.to(dtype), wt.zeros.to(dtype), group, t, counters)
        assert out.dtype == dtype and out.shape == (m, 64)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert (out.double() - ref).abs().max().item() < tol * ref.abs().max().item()
        assert not counters.any(), "split-K counters must be reset for the next call"


def test_dot_gemm_refuses_what_does_not_fit():
    from tokenmill.layers.quantization.triton_int4_dot_gemm import DotTiles, dot_gemm

    wt = _case(n=48)
    qm = packing.to_mma(wt.qweight)
    with pytest.raises(ValueError, match="BLOCK_K 64 or 128"):
        dot_gemm(torch.randn(16, 256), qm, wt.scales, wt.zeros, 64, DotTiles(16, 32, 64, 4, 1))
    with pytest.raises(ValueError, match="BLOCK_K 64 or 128"):  # a K tile across two groups
        dot_gemm(torch.randn(16, 256), packing.to_mma(_case().qweight), wt.scales, wt.zeros, 64,
                 DotTiles(16, 32, 128, 4, 1))


# ---------------------------------------------------------------- the PTX dequantization, emulated

def _half16(bits: int, dtype: torch.dtype) -> float:
    return torch.tensor([bits - (1 << 16) if bits >= 1 << 15 else bits], dtype=torch.int16).view(dtype).item()


def _bits16(v: float, dtype: torch.dtype) -> int:
    return torch.tensor([v], dtype=torch.float64).to(torch.float32).to(dtype).view(torch.int16).item() & 0xFFFF


def _run_ptx(asm: str, regs: dict, dtype: torch.dtype) -> dict:
    """Runs the straight-line PTX of `_deq_asm` (mov, prmt, xor, shr, lop3, packed fma) on ints."""
    def val(a):
        a = a.strip()
        return int(a, 0) & 0xFFFFFFFF if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", a) else regs[a]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(("{", "}", ".reg")):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        v = [val(a) for a in src]
        if op == "mov.b32":
            r = v[0]
        elif op == "prmt.b32":
            data = v[0] | (v[1] << 32)
            r = sum(((data >> (8 * ((v[2] >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "xor.b32":
            r = v[0] ^ v[1]
        elif op == "shr.u32":
            r = v[0] >> v[1]
        elif op == "lop3.b32":  # bit i of the result: LUT bit (4 a + 2 b + c)
            r = sum(((v[3] >> (4 * ((v[0] >> i) & 1) + 2 * ((v[1] >> i) & 1) + ((v[2] >> i) & 1))) & 1) << i
                    for i in range(32))
        elif op.startswith("fma.rn."):
            halves = []
            for h in (0, 16):
                a, b, c = (_half16((x >> h) & 0xFFFF, dtype) for x in v)
                halves.append(_bits16(a * b + c, dtype) << h)
            r = halves[0] | halves[1]
        else:
            raise AssertionError(f"the emulator does not know {op}")
        regs[d] = r & 0xFFFFFFFF
    return regs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ptx_dequantization_emulated(dtype):
    """Every nibble of two words, with two channels' scales and zero points per word (even nibbles:
    channel g, odd: g + 8), comes out as (q - z) * s rounded once in the 16-bit dtype; a wrong
    shift, mask, pairing or sign fails it."""
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dg

    asm = (dg._ASM_BF16 if dtype == torch.bfloat16 else dg._ASM_FP16).value
    asm = asm.replace("$", "r")  # operands as register names
    g = torch.Generator().manual_seed(1)
    for trial in range(4):
        words = torch.randint(0, 1 << 32, (2,), generator=g, dtype=torch.int64).tolist()
        scales = (torch.rand(2, 2, generator=g) * 0.1 + 0.001).to(dtype)  # [element, channel lo/hi]
        zeros = torch.randint(0, 16, (2, 2), generator=g).tolist()
        sz = dg.packed_scale_offset(scales, torch.tensor(zeros, dtype=dtype))  # int32 [element, channel]
        regs = {f"r{8 + i}": words[i] for i in range(2)}
        for e in range(2):
            regs[f"r{10 + e}"] = sz[e, 0].item() & 0xFFFFFFFF
            regs[f"r{12 + e}"] = sz[e, 1].item() & 0xFFFFFFFF
        out = _run_ptx(asm, regs, dtype)
        for nib in range(8):
            for e in range(2):
                q = (words[e] >> (4 * nib)) & 0xF
                ch = nib % 2
                want = torch.tensor([(q - zeros[e][ch]) * scales[e, ch].item()], dtype=torch.float64).to(dtype)
                got = _half16((out[f"r{nib}"] >> (16 * e)) & 0xFFFF, dtype)
                assert got == want.item(), (trial, nib, e, got, want.item())


def test_mma_matmul_routes_by_the_table(monkeypatch):
    """A (rows bucket, N, K) listed in `triton_int4_dot_gemm.TABLE` takes the dot GEMM (right
    result); an unlisted row count does not."""
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot
    from tokenmill.layers.quantization import triton_int4_mma as mma

    wt = _case()
    qm = packing.to_mma(wt.qweight)
    calls = []
    real = dot.dot_gemm
    monkeypatch.setattr(dot, "dot_gemm", lambda *a, **kw: calls.append(a[5]) or real(*a, **kw))
    monkeypatch.setattr(dot, "TABLE", {(32, 64, 256): dot.DotTiles(16, 32, 64, 4, 1, deq=1)})
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(3))
    out = mma.mma_matmul(x, qm, wt.scales, wt.zeros, 64)
    ref = x.double() @ packing.dequantize(wt, 64, torch.float64)
    assert calls == [dot.DotTiles(16, 32, 64, 4, 1, deq=1)]
    assert (out.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
    assert dot.dot_tiles(40, 64, 256, 64) is None and dot.dot_tiles(20, 64, 256, 64) is not None


def test_table_entries_fit_their_shapes():
    """Every measured entry names a launch that takes its (N, K) at group 128 in its rows bucket."""
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot

    for (bucket, n, k), t in dot.TABLE.items():
        assert bucket in dot.BUCKETS
        assert dot.dot_tiles(bucket, n, k, 128) == t, (bucket, n, k, t)
        gluon = isinstance(t, (dot.GluonTiles, dot.SwapTiles))  # bf16 only
        assert dot.dot_tiles(bucket, n, k, 128, torch.float16) == (None if gluon else t)


def test_gemm_selftest_passes_and_switches_the_gemm_off(monkeypatch, caplog):
    """`int4.gemm_selftest` (once per device, when the engine takes the mma layout) runs every launch
    the table lists against the reference; a wrong or failing GEMM is switched off, with a warning,
    and `dot_tiles` then sends every row count to the other paths."""
    from tokenmill.layers.quantization import int4
    from tokenmill.layers.quantization import int4_wsa_route as wsa
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot

    t = dot.DotTiles(16, 32, 64, 4, 1, split=2, deq=1)
    monkeypatch.setattr(dot, "TABLE", {(16, 256, 512): t})
    monkeypatch.setattr(wsa, "ENABLED", True)  # a failure below switches it off too: restored after the test
    monkeypatch.setattr(int4, "_GEMM_SELFTEST", {})
    assert int4.gemm_selftest(torch.device("cpu"), torch.float16) and dot.ENABLED
    assert dot.dot_tiles(16, 256, 512, 128, torch.float16) == t
    real = dot.run
    for broken in (lambda *a, **kw: real(*a, **kw) * 1.05,
                   lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("CompilationError"))):
        monkeypatch.setattr(int4, "_GEMM_SELFTEST", {})
        monkeypatch.setattr(dot, "ENABLED", True)
        monkeypatch.setattr(dot, "run", broken)
        with caplog.at_level("WARNING"):
            assert not int4.gemm_selftest(torch.device("cpu"), torch.float16)
        assert "self-test" in caplog.text and not dot.ENABLED
        assert dot.dot_tiles(16, 256, 512, 128, torch.float16) is None
