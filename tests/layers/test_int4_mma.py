"""The tensor-core INT4 GEMV (`triton_int4_mma`) under TRITON_INTERPRET=1 against a float64 torch
reference: its weight layout (`int4_packing.to_mma` / `from_mma`, checked nibble by nibble against
the documented map), 1..8 rows, split-K (counters come back zeroed), groups of 64 and 128,
float32 and float16 activations; the dequantization of the layout; `mma_matmul` for more rows;
the launches it refuses. The inline PTX itself runs on a GPU only (scripts/gpu_int4_sweep.py
checks it against the same reference).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers.requirements import require_module
from tokenmill.layers.quantization import int4_packing as packing

require_module("triton")  # skipped on a machine without it; in CI, missing fails


def _case(n=64, k=256, group=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = packing.quantize_int4(torch.randn(n, k, generator=g), group, sym=False)
    codes.scales = codes.scales.half().float()
    return packing.from_codes(codes, torch.float32, act_order=False)


def test_mma_layout_round_trip_and_map():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (128, 32), generator=g)
    words = packing.pack_along(codes, 0)
    qm = packing.to_mma(words)
    assert qm.shape == (2, 2, 32, 4) and qm.dtype == torch.int32
    assert torch.equal(packing.from_mma(qm), words)
    for cb in range(2):  # the map the kernel's fragments assume (module docstring)
        for s in range(2):
            for lane in range(32):
                for m in range(4):
                    word = qm[cb, s, lane, m].item()
                    for nib in range(8):
                        ch = cb * 16 + lane // 4 + 8 * (nib % 2)
                        k = 64 * s + 16 * (lane % 4) + 4 * m + 2 * ((nib % 4) // 2) + nib // 4
                        assert (word >> (4 * nib)) & 0xF == codes[k, ch].item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,group,warps,split", [(1, 64, 1, 1), (1, 64, 2, 4), (3, 128, 4, 2), (8, 64, 1, 2),
                                                 (5, 128, 2, 1)])
def test_mma_gemv_matches_reference(m, group, warps, split, dtype):
    from tokenmill.layers.quantization.triton_int4_mma import MmaGemv, mma_gemv

    wt = _case(group=group)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = x.double() @ packing.dequantize(wt, group, torch.float64)
    qm = packing.to_mma(wt.qweight)
    counters = torch.zeros(8, dtype=torch.int32)
    for _ in range(2):  # a second call reuses the counters
        out = mma_gemv(x, qm, wt.scales.to(dtype), wt.zeros.to(dtype), group, MmaGemv(warps, split), counters)
        assert out.dtype == dtype and out.shape == (m, 64)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert (out.double() - ref).abs().max().item() < tol * ref.abs().max().item()
        assert not counters.any(), "split-K counters must be reset for the next call"


def test_mma_dequantize_and_matmul_match_reference(monkeypatch):
    from tokenmill.layers.quantization import triton_int4_mma as mma

    launches = []
    real = mma.mma_gemv
    monkeypatch.setattr(mma, "mma_gemv", lambda *a, **kw: launches.append(a[0].shape[0]) or real(*a, **kw))
    wt = _case(n=32, k=128, group=64)
    qm = packing.to_mma(wt.qweight)
    ref_w = packing.dequantize(wt, 64, torch.float32)
    assert torch.equal(mma.mma_dequantize(qm, wt.scales, wt.zeros, 64, torch.float32), ref_w)
    counters = torch.zeros(4, dtype=torch.int32)
    for m, rows in ((12, [8, 4]), (40, [])):  # looped 8-row GEMVs; dequantize + matmul
        x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m))
        launches.clear()
        out = mma.mma_matmul(x, qm, wt.scales, wt.zeros, 64, counters)
        assert out.shape == (m, 32) and torch.allclose(out, x @ ref_w, rtol=1e-4, atol=1e-4)
        assert launches == rows


def test_mma_gemv_refuses_what_does_not_fit():
    from tokenmill.layers.quantization.triton_int4_mma import MmaGemv, mma_gemv

    wt = _case()
    qm = packing.to_mma(wt.qweight)
    with pytest.raises(ValueError, match="at most 8 rows"):
        mma_gemv(torch.randn(9, 256), qm, wt.scales, wt.zeros, 64, MmaGemv(1, 1))
    with pytest.raises(ValueError, match="SPLIT"):
        mma_gemv(torch.randn(1, 256), qm, wt.scales, wt.zeros, 64, MmaGemv(1, 3))
    with pytest.raises(ValueError, match="counters"):
        mma_gemv(torch.randn(1, 256), qm, wt.scales, wt.zeros, 64, MmaGemv(1, 2))
    with pytest.raises(ValueError, match="multiple of 64"):
        packing.to_mma(packing.pack_along(torch.zeros(96, 16, dtype=torch.int64), 0))
    from tokenmill.layers.quantization.triton_int4_mma import layout_fits

    assert layout_fits(4096, 4096, 128) and layout_fits(32, 512, 256)
    assert not layout_fits(4096, 4096, 512) and not layout_fits(4096, 4096, 32) and not layout_fits(40, 4096, 128)


def test_int4_matmul_sends_the_mma_layout_to_mma_matmul(monkeypatch):
    """A 4-D weight (the mma layout `int4.for_device` makes on CUDA) goes to `mma_matmul` at
    every row count; the result matches the reference."""
    from tokenmill.layers.quantization import triton_int4
    from tokenmill.layers.quantization import triton_int4_mma as mma

    wt = _case(n=32, k=128)
    qm = packing.to_mma(wt.qweight)
    calls = []
    real = mma.mma_matmul
    monkeypatch.setattr(mma, "mma_matmul", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for m in (1, 5):
        x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m))
        out = triton_int4.int4_matmul(x, qm, wt.scales, wt.zeros, None, 64, torch.zeros(8, dtype=torch.int32))
        torch.testing.assert_close(out, x @ packing.dequantize(wt, 64, torch.float32), rtol=1e-4, atol=1e-4)
    assert calls == [1, 5]


def _fragment_coords(lane: int):
    """(row, col) of mma.m16n8k16's A elements a0..a7 and B elements b0..b3 held by `lane` (the
    PTX ISA's "Matrix Fragments for mma.m16n8k16 with floating point type")."""
    g, t = lane >> 2, lane % 4
    a = [(g if i < 2 or 4 <= i < 6 else g + 8, t * 2 + (i & 1) + (8 if i >= 4 else 0)) for i in range(8)]
    b = [(t * 2 + (i & 1) + (8 if i >= 2 else 0), g) for i in range(4)]
    return a, b


def test_mma_fragments_the_ptx_builds_compute_the_product():
    """A model of what `_asm` hands the tensor cores, lane by lane: register pair p of word m is
    nibbles (p, p + 4) of the lane's word (one lop3 after a shift by 4p), minus the zero point of
    channel g (pairs 0, 2) or g + 8 (pairs 1, 3); the B pairs are the lane's x values
    16 j + 4 m + (0, 1) and (2, 3) of x row g. Placed by the PTX fragment map and multiplied, the
    16 x 8 D must be W x^T for the block's 16 channels and 8 rows."""
    g_ = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (64, 16), generator=g_)  # [K, N]: one K step, one channel block
    zeros = torch.randint(0, 16, (16,), generator=g_)
    x = torch.randn(8, 64, generator=g_, dtype=torch.float64)
    qm = packing.to_mma(packing.pack_along(codes, 0))
    d = torch.zeros(16, 8, dtype=torch.float64)
    for m in range(4):
        a_mat = torch.zeros(16, 16, dtype=torch.float64)
        b_mat = torch.zeros(16, 8, dtype=torch.float64)
        for lane in range(32):
            g, j = lane >> 2, lane % 4
            word = qm[0, 0, lane, m].item() & 0xFFFFFFFF
            regs = [((word >> (4 * p)) & 0xF, (word >> (16 + 4 * p)) & 0xF) for p in range(4)]
            zs = [zeros[g], zeros[g + 8], zeros[g], zeros[g + 8]]
            a_vals = [float(q - zs[p]) for p in range(4) for q in regs[p]]  # a0..a7, low half first
            xb = 16 * j + 4 * m
            b_vals = [x[g, xb], x[g, xb + 1], x[g, xb + 2], x[g, xb + 3]]  # x pairs {X[2m]}, {X[2m+1]}
            a_pos, b_pos = _fragment_coords(lane)
            for (r, c), v in zip(a_pos, a_vals):
                a_mat[r, c] = v
            for (r, c), v in zip(b_pos, b_vals):
                b_mat[r, c] = v
        d += a_mat @ b_mat
    ref = (codes.double() - zeros.double()[None, :]).t() @ x.t()  # [16 channels, 8 rows]
    torch.testing.assert_close(d, ref)


def test_mma_ptx_assembles_for_sm90():
    """The inline PTX of the engine's default launch and of the sweep's variants (fp16, split-K,
    two groups a step, zero points by mma, load hints, the SiLU epilogue, a register cap, the folded
    norm and residual add) compiles to sm_90 SASS with triton's
    bundled ptxas, no GPU needed (`scripts/int4_mma_sass.py`, in a process of its own: a real
    compile, not the interpreter): a typo fails here, not on the H100. Every 16-byte load of a
    loop step is issued before its first mma (the `early` predicate), and nothing spills."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "int4_mma_sass.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    launches = ['{"warps": 4, "split": 1}', '{"warps": 4, "split": 4, "gpc": 2, "zmma": true, "hint": true, "f16": true}',
                '{"warps": 4, "split": 8, "pdl": true}', '{"warps": 4, "split": 2, "gpc": 2, "hint": true, "pdl": true}',
                '{"warps": 4, "split": 8, "pdl": true, "pre": false}', '{"warps": 4, "split": 4, "pdl": true, "group": 256}',
                '{"warps": 4, "split": 8, "pdl": true, "ahead": 2}', '{"warps": 4, "split": 2, "pdl": true, "ring": 8}',
                '{"warps": 4, "split": 2, "pdl": true, "hint": true, "silu": true}', '{"warps": 4, "split": 1, "pdl": true, "silu": true}',
                '{"warps": 4, "split": 8, "pdl": true, "hint": true, "maxnreg": 48}',
                '{"warps": 4, "split": 2, "pdl": true, "hint": true, "pipe": true}', '{"warps": 8, "split": 16, "pdl": true, "pipe": true}',
                # the folded norm (`int4_norm_fold`: gate_up's and qkv's launches) and residual add (down's, o's)
                '{"warps": 4, "split": 2, "pdl": true, "hint": true, "pipe": true, "silu": true, "norm": true, "sq": true}',
                '{"warps": 4, "split": 8, "pdl": true, "hint": true, "pipe": true, "norm": true}',
                '{"warps": 4, "split": 16, "pdl": true, "hint": true, "res": true, "sq": true}',
                '{"warps": 8, "split": 16, "pdl": true, "res": true, "sq": true}',
                # scale mode: rows times rstd after the GEMV (qkv, gate_up); the adds also write y (o, down)
                '{"warps": 4, "split": 2, "pdl": true, "hint": true, "pipe": true, "silu": true, "rstd": true}',
                '{"warps": 4, "split": 16, "pdl": true, "hint": true, "res": true, "sq": true, "yw": true}']
    proc = subprocess.run([sys.executable, str(script)] + [a for j in launches for a in ("--launch", j)],
                          check=False, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode and ("ptxas" in proc.stderr or "cuobjdump" in proc.stderr) and "No such file" in proc.stderr:
        pytest.skip("triton without its bundled CUDA tools")  # pragma: no cover
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("} {") for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(launches)
    for launch, figs in ((json.loads(a + "}"), json.loads("{" + b)) for a, b in rows):
        # a register cap below what ptxas would take (~56) reaches it: it spills instead
        assert figs["HMMA"] > 0 and (figs["stack"] == 0) == ("maxnreg" not in launch), (launch, figs)
        assert figs["reg"] <= launch.get("maxnreg", 255), (launch, figs)
        if launch.get("norm"):  # the norm's prologue must not cost the GEMV its one wave (8 CTAs of 4 warps an SM)
            assert figs["reg"] <= 64, (launch, figs)
        # PDL: the first step's weight words (one 16-byte load per K step) and nothing else before
        # the wait (x, partials and counters are another kernel's); without `pre`, no load at all
        pipe = launch.get("pipe", False)  # its first step's words and scales before the wait, in its own loads
        pre = (launch.get("pdl") and launch.get("pre", True) and not launch.get("ring") and not pipe
               and not launch.get("norm"))  # (a ring, a folded norm: no preload)
        steps = launch.get("group", 128) // 64 * launch.get("gpc", 1)  # 64-input K steps a loop step
        # (a preloaded first step is peeled: its words and x, 3 loads a K step; with groups of 256
        # ptxas may start its first mma before the step's last x load)
        if launch.get("early", True) and launch.get("group", 128) == 128:
            assert figs["wide_loads_before_first_hmma"] == (3 * steps if pre else figs["wide_loads"]), (launch, figs)
        assert ("plain_loads_before_wait" in figs) == bool(launch.get("pdl")), (launch, figs)
        if launch.get("pdl"):
            # (pipe: its first step's words and scales (constant) by plain loads: 2 + 4; never x)
            assert figs["plain_loads_before_wait"] == (6 if pipe else 0), (launch, figs)
            assert figs["wide_loads_before_wait"] == (steps if pre or pipe else 0), (launch, figs)
            # `ahead`: the loop steps after the first prefetched before the wait as well
            assert figs["prefetches_before_wait"] == (launch.get("ahead", 0) * steps if pre else 0), (launch, figs)


def test_mma_gemv_takes_rows_of_any_stride():
    """x's rows are read in 16-byte vectors: a view whose rows start off a 16-byte boundary (or
    with a stride not a multiple of 8 values) is copied first; the result is the same."""
    from tokenmill.layers.quantization.triton_int4_mma import MmaGemv, mma_gemv, vector_rows

    wt = _case(n=32, k=128)
    qm = packing.to_mma(wt.qweight)
    big = torch.randn(3, 136, generator=torch.Generator().manual_seed(9))
    for view, copied in ((big[:, :128], False), (big[:, 1:129], True), (big[1:, 4:132], False),
                         (torch.randn(3, 133)[:, :128], True)):
        y = vector_rows(view)
        assert (y.data_ptr() != view.data_ptr()) == copied and torch.equal(y, view)
        assert y.data_ptr() % 16 == 0 and (y.stride(0) * y.element_size()) % 16 == 0 and y.stride(1) == 1
    x = big[:, 1:129]  # offset one value
    out = mma_gemv(x, qm, wt.scales, wt.zeros, 64, MmaGemv(1, 1))
    torch.testing.assert_close(out, x @ packing.dequantize(wt, 64, torch.float32), rtol=1e-4, atol=1e-4)


def test_mma_selftest_passes_and_falls_back(monkeypatch, caplog):
    """`int4.mma_selftest` (run once per device before the engine takes the mma layout) passes on
    the kernel as it is (here the interpreter's program) and fails, with a warning, on a GEMV
    that is wrong or does not compile: then the engine keeps the panels."""
    from tokenmill.layers.quantization import int4
    from tokenmill.layers.quantization import triton_int4_mma as mma

    monkeypatch.setattr(int4, "_SELFTEST", {})
    assert int4.mma_selftest(torch.device("cpu"), torch.float16)
    real = mma.mma_gemv
    for broken in (lambda *a, **kw: real(*a, **kw) * 1.05,
                   lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("CompilationError"))):
        monkeypatch.setattr(int4, "_SELFTEST", {})
        monkeypatch.setattr(mma, "mma_gemv", broken)
        with caplog.at_level("WARNING"):
            assert not int4.mma_selftest(torch.device("cpu"), torch.float16)
        assert "self-test" in caplog.text


def test_launch_labels_round_trip_and_the_env_table(monkeypatch):
    """`parse_label` reads what `MmaGemv.label` writes (every flag), refuses what it cannot read,
    and TOKENMILL_INT4_MMA_TABLE's entries take precedence over TABLE and the default launch."""
    from tokenmill.layers.quantization import triton_int4_mma as mma

    for c in (mma.MmaGemv(), mma.MmaGemv(8, 16, 2, False, True, True, False, True), mma.MmaGemv(2, 4, pre=False),
              mma.MmaGemv(4, 8, hint=True), mma.MmaGemv(4, 8, ahead=2), mma.MmaGemv(4, 2, ahead=1, ahead_l1=True),
              mma.MmaGemv(4, 2, ring=8, hint=True)):
        assert mma.parse_label(c.label()) == c, c.label()
    with pytest.raises(ValueError, match="expected"):
        mma.parse_label("w4 s8")
    with pytest.raises(ValueError, match="expected"):
        mma.parse_label("w4 s8 g1 fast")
    monkeypatch.delenv(mma.TABLE_ENV, raising=False)
    assert mma.config_for(6144, 4096, 128) == mma.TABLE[(6144, 4096)]
    assert mma.config_for(6144, 8192, 128) == mma.default_config(6144, 8192, 128)
    assert all(mma.fits(n, k, 128, c) for (n, k), c in mma.TABLE.items())
    monkeypatch.setenv(mma.TABLE_ENV, "6144x4096=mma w4 s4 g1 hint; 4096x4096=w2 s16 g1 nopdl")
    assert mma.config_for(6144, 4096, 128) == mma.MmaGemv(4, 4, hint=True)
    assert mma.config_for(4096, 4096, 128) == mma.MmaGemv(2, 16, pdl=False)
    assert mma.config_for(28672, 4096, 128) == mma.TABLE[(28672, 4096)]


# each launch shape in one dtype, the first in both (the dtype changes the roundings, not the launch)
@pytest.mark.parametrize("m,group,warps,split,dtype", [
    (1, 64, 1, 1, torch.float32), (1, 64, 1, 1, torch.float16), (3, 64, 2, 4, torch.float16),
    (8, 128, 4, 2, torch.float32), (2, 128, 1, 1, torch.float16)])
def test_mma_gemv_silu_epilogue_matches_the_unfused_path(m, group, warps, split, dtype):
    """SILU: a [gate | up] weight in `gate_up_pairs` order gives silu(gate) * up [M, I] in one
    launch: the plain GEMV of the natural weight then `silu_and_mul`, bit for bit (the same sums,
    rounded where the unfused path rounds), and close to a float64 reference."""
    from tokenmill.layers.quantization.triton_int4_mma import MmaGemv, mma_gemv
    from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul

    n, k = 128, 256
    wt = _case(n=n, k=k, group=group, seed=4)
    perm = packing.gate_up_pairs(n)
    assert sorted(perm.tolist()) == list(range(n)) and perm[:16].tolist() == [*range(8), *range(64, 72)]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5)).to(dtype)
    s, z = wt.scales.to(dtype), wt.zeros.to(dtype)
    counters = torch.zeros(8, dtype=torch.int32)
    c = MmaGemv(warps, split)
    plain = silu_and_mul(mma_gemv(x, packing.to_mma(wt.qweight), s, z, group, c, counters))
    qp = packing.to_mma(wt.qweight[:, perm])
    for _ in range(2):  # a second call reuses the counters
        fused = mma_gemv(x, qp, s[:, perm], z[:, perm], group, c, counters, silu=True)
        assert fused.shape == (m, n // 2) and fused.dtype == dtype
        assert torch.equal(fused, plain)
        assert not counters.any()
    ref = x.double() @ packing.dequantize(wt, group, torch.float64)
    ref = torch.nn.functional.silu(ref[:, :n // 2]) * ref[:, n // 2:]
    assert (fused.double() - ref).abs().max().item() < 1e-2 * ref.abs().max().item()
    # the check can fail: the natural order (not paired) through the epilogue is another product
    assert not torch.equal(mma_gemv(x, packing.to_mma(wt.qweight), s, z, group, c, counters, silu=True), plain)


@pytest.mark.parametrize("m", [1, 8, 11])
def test_int4_method_silu_mul_on_a_paired_weight(m):
    """`Int4LinearMethod.apply_silu_mul` on a [gate | up] weight paired at load (`int4.pair_gate_up`):
    up to 8 rows the GEMV's epilogue, more rows the paired result through `silu_and_mul(paired=True)`;
    both equal to `silu_and_mul` of the natural GEMV's result; `apply`'s path puts the paired
    result back in natural order (`pair_order`)."""
    from types import SimpleNamespace

    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.quantization import int4
    from tokenmill.layers.quantization import triton_int4_mma as mma
    from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul

    n, k, group = 128, 256, 64
    wt = _case(n=n, k=k, group=group, seed=6)
    wt = packing.Int4Weights(packing.to_mma(wt.qweight), wt.scales.half(), wt.zeros.half(), None)
    paired, order = int4.pair_gate_up(wt)
    counters = torch.zeros(16, dtype=torch.int32)
    layer = SimpleNamespace(qweight=paired.qweight, scales=paired.scales, zeros=paired.zeros, pair_order=order,
                            stream_counters=SimpleNamespace(tensor=counters))
    method = SimpleNamespace(config=SimpleNamespace(group_size=group))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).half()
    natural = mma.mma_matmul(x, wt.qweight, wt.scales, wt.zeros, group, counters)
    assert torch.equal(mma.mma_matmul(x, paired.qweight, paired.scales, paired.zeros, group, counters)
                       .index_select(-1, order), natural)
    out = int4.Int4LinearMethod.apply_silu_mul(method, layer, x, None, SiluAndMul())
    assert out.shape == (m, n // 2) and torch.equal(out, silu_and_mul(natural))
    assert not counters.any()


def test_silu_selftest_passes_and_falls_back(monkeypatch, caplog):
    """The SiLU epilogue's self-test passes on the interpreter; a broken epilogue turns it off, logged."""
    from tokenmill.layers.quantization import int4
    from tokenmill.layers.quantization import triton_int4_mma as mma

    monkeypatch.setattr(int4, "_SILU_SELFTEST", {})
    assert int4.silu_selftest(torch.device("cpu"), torch.float16)
    real = mma.mma_gemv
    monkeypatch.setattr(int4, "_SILU_SELFTEST", {})
    monkeypatch.setattr(mma, "mma_gemv", lambda *a, **kw: real(*a, **kw) * 1.1)
    assert not int4.silu_selftest(torch.device("cpu"), torch.float16)
    assert "SiLU-and-mul epilogue failed its self-test" in caplog.text


def test_pipelined_launches_leave_the_table_when_their_selftest_failed(monkeypatch):
    """`PIPE_ENABLED` off (`int4._pipe_selftest` failed on the device): the table's pipelined
    launches run without the loop, everything else as listed."""
    from tokenmill.layers.quantization import triton_int4_mma as mma

    shape = (28672, 4096)
    assert mma.TABLE[shape].pipe and mma.config_for(*shape, 128) == mma.TABLE[shape]
    monkeypatch.setattr(mma, "PIPE_ENABLED", False)
    c = mma.config_for(*shape, 128)
    assert not c.pipe and c == mma.MmaGemv(**{**vars(mma.TABLE[shape]), "pipe": False})
    assert mma.parse_label("mma w4 s2 g1 hint a1 pipe m56") == mma.MmaGemv(4, 2, hint=True, ahead=1, pipe=True, maxnreg=56)
