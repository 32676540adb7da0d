"""The warp-specialized Gluon INT4 GEMM (`gluon_int4_ws_gemm`: a TMA loader warp, dequantizer warps
filling a ring of bf16 B tiles, a wgmma consumer). Gluon has no interpreter, so the CPU checks its
parts: the dequantizers' word -> B tile map and rounding (`step_tile`) and the split-K slice order
(`emulate`) against a float64 reference from the codes, the wrapper's refusals, and an offline sm_90
compile (three partitions on their own named barriers, wgmmas left in flight, mbarrier arrives, no
local memory). On a GPU scripts/gpu_int4_ws.py checks every launch against a float32 reference.
"""

from __future__ import annotations

import itertools
import os
import re

import pytest
import torch

from tests.helpers.requirements import require_module
from tokenmill.layers.quantization import int4_packing as packing

require_module("triton")  # skipped on a machine without it; in CI, missing fails


@pytest.fixture(autouse=True)
def _ws_route_enabled(monkeypatch):
    """An earlier test's `int4.gemm_selftest` may have switched the ws route off for the process."""
    from tokenmill.layers.quantization import int4_ws_route as ws
    monkeypatch.setattr(ws, "ENABLED", True)


def _case(n, k, group, m=24, seed=0):
    """(codes, mma words, packed scales / offsets, x bf16)."""
    from tokenmill.layers.quantization.triton_int4_dot_gemm import packed_scale_offset

    g = torch.Generator().manual_seed(seed)
    codes = packing.quantize_int4(torch.randn(n, k, generator=g), group, sym=False)
    wt = packing.from_codes(codes, torch.bfloat16, act_order=False)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    return codes, packing.to_mma(wt.qweight), packed_scale_offset(wt.scales, wt.zeros), x


def _reference_w(codes, group) -> torch.Tensor:
    """w^T [K, N] in float64 from the codes (scales / zeros rounded to bf16 as stored)."""
    s = codes.scales.to(torch.bfloat16).double()
    z = codes.zeros.to(torch.bfloat16).double()
    return ((codes.codes.double() - z[:, codes.g_idx]) * s[:, codes.g_idx]).t()


@pytest.mark.parametrize("bn,group", [(128, 128), (64, 64)])
def test_step_tiles_are_the_weights_rounded_once(bn, group):
    """Every B tile is the float64 weight rounded once to bf16, element for element (a wrong nibble,
    lane or channel map, or a scale of the wrong group, fails)."""
    from tokenmill.layers.quantization.gluon_int4_ws_gemm import step_tile

    n, k = 256, 256
    codes, qm, sz, _ = _case(n, k, group)
    ref = _reference_w(codes, group).to(torch.bfloat16).float()
    for pid_n in range(n // bn):
        for step in range(k // 64):
            got = step_tile(qm, sz, step, pid_n, bn, group)
            want = ref[step * 64:(step + 1) * 64, pid_n * bn:(pid_n + 1) * bn]
            assert torch.equal(got, want), (pid_n, step)


@pytest.mark.parametrize("bn", [128, 64])
def test_tile_maps_put_every_weight_at_its_input_and_channel(bn):
    """`TO_KN` / `TO_NK` (the dequantizers' permute of [CB, 1, g, j, m, hi, a, b] before the reshape) put
    nibble hi + 2 a + 4 b of lane (g, j)'s word m of block cb at input 16 j + 4 m + 2 a + b and channel
    16 cb + 8 hi + g: row k, column n of the [64, BN] tile, and row n, column k of the K-major [BN, 64]
    one (a wrong axis in either fails)."""
    pytest.importorskip("triton.experimental.gluon")
    from tokenmill.layers.quantization.gluon_int4_ws_gemm import TO_KN, TO_NK

    cb, g, j, m, hi, a, b = torch.meshgrid(*(torch.arange(d) for d in (bn // 16, 8, 4, 4, 2, 2, 2)), indexing="ij")
    k = (16 * j + 4 * m + 2 * a + b).unsqueeze(1)  # [CB, 1, g, j, m, hi, a, b]
    n = (16 * cb + 8 * hi + g).unsqueeze(1)
    rows, cols = torch.meshgrid(torch.arange(64), torch.arange(bn), indexing="ij")
    assert torch.equal(k.permute(TO_KN.value).reshape(64, bn), rows)
    assert torch.equal(n.permute(TO_KN.value).reshape(64, bn), cols)
    assert torch.equal(k.permute(TO_NK.value).reshape(bn, 64), rows.t())
    assert torch.equal(n.permute(TO_NK.value).reshape(bn, 64), cols.t())
    # K-major: a thread's 16 inputs of one channel (m, a, b) are 16 consecutive inputs (two 16-byte stores)
    assert TO_NK.value[-3:] == (4, 6, 7)
    # kmajor 2: `_ASM_WORD`'s outputs o_t (t = hi + 2 a: nibbles t, t + 4 of the word, inputs 2 kk, 2 kk + 1,
    # kk = 8 j + 2 m + a) joined as the kernel does (gl.join appends the new axis last, as torch.stack(-1))
    # -> [BN, 32] int32 pairs by TO_NK_PAIRS
    from tokenmill.layers.quantization.gluon_int4_ws_gemm import TO_NK_PAIRS

    cb, g, j, m = torch.meshgrid(*(torch.arange(d) for d in (bn // 16, 8, 4, 4)), indexing="ij")
    o = [((8 * j + 2 * m + t // 2).unsqueeze(1), (16 * cb + 8 * (t % 2) + g).unsqueeze(1)) for t in range(4)]
    kk, n = (torch.stack([torch.stack([o[0][i], o[1][i]], -1), torch.stack([o[2][i], o[3][i]], -1)], -1)
             for i in (0, 1))
    rows, cols = torch.meshgrid(torch.arange(bn), torch.arange(32), indexing="ij")
    assert torch.equal(n.permute(TO_NK_PAIRS.value).reshape(bn, 32), rows)
    assert torch.equal(kk.permute(TO_NK_PAIRS.value).reshape(bn, 32), cols)


@pytest.mark.parametrize("split", [1, 2, 4])
def test_emulated_product_matches_float64_reference(split):
    """The tiles times x over the K slices, summed in slice order, is x @ W^T within bf16 rounding."""
    from tokenmill.layers.quantization.gluon_int4_ws_gemm import WsTiles, emulate

    codes, qm, sz, x = _case(128, 512, 128, m=40)
    ref = x.double() @ _reference_w(codes, 128)
    out = emulate(x, qm, sz, 128, WsTiles(bm=128, bn=64), split=split)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 4e-3, err


def test_wrapper_refuses_what_the_kernel_cannot_do():
    """fp16 x, N not a multiple of the channel tile, a group not of 64: ValueError,
    before any launch (so on the CPU)."""
    from tokenmill.layers.quantization.gluon_int4_ws_gemm import WsTiles, ws_gemm

    _, qm, sz, x = _case(128, 256, 64)
    scales = torch.ones(4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 x"):
        ws_gemm(x.half(), qm, scales, scales, 64, sz=sz)
    with pytest.raises(ValueError, match="N a multiple of 256"):
        ws_gemm(x, qm, scales, scales, 64, WsTiles(bn=256), sz=sz)
    with pytest.raises(ValueError, match="group"):
        ws_gemm(x, qm, scales, scales, 96, sz=sz)


def test_split_follows_the_counters_and_divides_the_steps():
    """split-K only with a counter per output tile, lowered until it divides K / 64."""
    from tokenmill.layers.quantization.gluon_int4_ws_gemm import WsTiles, split_for

    t = WsTiles(split=4)
    assert split_for(t, 4096, 32, torch.zeros(32, dtype=torch.int32)) == 4
    assert split_for(t, 4096, 33, torch.zeros(32, dtype=torch.int32)) == 1
    assert split_for(t, 4096, 32, None) == 1
    assert split_for(t, 192, 8, torch.zeros(8, dtype=torch.int32)) == 3  # 3 steps
    assert split_for(WsTiles(split=4), 64 * 14, 8, torch.zeros(8, dtype=torch.int32)) == 2


@pytest.mark.parametrize("bm,warps,split,kmajor", [(128, 4, False, 0), (256, 8, True, 0), (256, 8, False, 1), (128, 4, True, 2)])
def test_compiles_for_sm90_warp_specialized(bm, warps, split, kmajor):
    """Offline sm_90 compile (no GPU): the consumer's wgmmas (a warpgroup's BM / 64 / warpgroups x 4
    k16 steps, a peeled step and the loop) with one left in flight, each partition on its own named
    barrier (the consumer's over its warps, the dequantizers' over 128 threads), mbarrier arrives,
    three TMA loads (x, words, scales) and no global load outside split-K's epilogue, register
    reallocation between partitions, no local memory."""
    pytest.importorskip("triton.experimental.gluon")
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    import sass_tools
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from tokenmill.layers.quantization.gluon_int4_ws_gemm import _ws_gemm_kernel as fn

    lay = gl.NVMMASharedLayout.get_default_for([bm, 64], gl.bfloat16)
    from tokenmill.layers.quantization.gluon_int4_ws_gemm import _PLAIN32

    const = {"GROUP": 128, "BN": 128, "STAGES": 4, "SPLIT_K": split, "DEQ_WARPS": 4, "DEQ_REGS": 168, "DEQ_PARTS": 1,
             "DIAG": 0, "PROBE": 0, "KMAJOR": kmajor}
    ptrs = {"out_ptr": "bf16", "part_ptr": "fp32", "cnt_ptr": "i32", "t_ptr": "i64"}
    descs = {"x_desc": f"tensordesc<bf16[{bm}, 64],{lay!r}>", "w_desc": f"tensordesc<i32[8, 128],{_PLAIN32!r}>",
             "s_desc": f"tensordesc<i32[1, 128],{_PLAIN32!r}>"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in descs:
            sig[name] = descs[name]
        elif name in ptrs:
            sig[name], attrs[(i,)] = "*" + ptrs[name], [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name in ("N", "K", "s_om"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps})
    fig, sass = sass_tools.disassemble(kernel)
    assert fig["stack"] <= (8 if split else 0), fig  # split-K's epilogue: one spilled word at most
    hgmma = len(re.findall(r"HGMMA\.64x128x16\.F32\.BF16", sass))
    assert hgmma == 2 * (bm // 16 // warps) * 4, hgmma  # per warpgroup
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass
    assert f"BAR.SYNC.DEFER_BLOCKING 0x0, {hex(32 * warps)}" in sass  # the consumer's own barrier
    assert re.search(r"BAR\.SYNC\.DEFER_BLOCKING 0x[2-9a-f], 0x80", sass)  # the dequantizers'
    assert sass.count("UTMALDG.2D") == 3 and "SYNCS.ARRIVE.TRANS64.A1T0" in sass  # x, words, scales
    if not split:  # no global load at all: words and scales arrive by TMA (a load in flight at the
        assert not re.findall(r"(?<![A-Z])LDG[.A-Z0-9]*", sass)  # dequantizers' fence stalls them)
    assert "USETMAXREG.DEALLOC" in sass
    # the B tile's stores: STSM.16.MT88 into the [64, BN] ring; 16-byte STS into the K-major one (8 a warp;
    # kmajor 2: no PRMT repacking the dequantized pairs before them, 8 for the scales' halves)
    if kmajor:
        assert "STSM" not in sass and sass.count("STS.128") >= 8, sass.count("STS.128")
        if kmajor == 2:
            assert sass.count("PRMT") <= 16, sass.count("PRMT")
    else:
        assert sass.count("STSM.16.MT88.4") == 8


def test_labels_parse_back_and_the_table_reads_the_environment_form():
    """`WsTiles.parse` inverts `label`; TOKENMILL_INT4_WS_TABLE's form becomes TABLE entries; a bad
    label or a bucket the engine does not use is refused."""
    from tokenmill.layers.quantization.int4_ws_route import WsTiles, table_from

    for t in (WsTiles(), WsTiles(256, 128, 4, 8), WsTiles(128, 64, 6, 4, 4, 2), WsTiles(128, 128, 4, 8, 8, 1, 112),
              WsTiles(256, 128, 4, 8, sk=132), WsTiles(128, 128, 4, 4, split=2, deq_regs=136, deq_parts=2),
              WsTiles(256, 128, 4, 8, deq_parts=0), WsTiles(256, 128, 4, 8, deq_parts=0, kmajor=1),
              WsTiles(128, 64, 6, 4, split=2, kmajor=1), WsTiles(256, 128, 4, 8, kmajor=2)):
        assert WsTiles.parse(t.label()) == t, t.label()
    got = table_from("256,28672,4096=ws m256 n128 st4 w8 d4 sk132; 256,4096,14336=ws m256 n128 st4 w8 d4 s4;")
    assert got == {(256, 28672, 4096): WsTiles(256, 128, 4, 8, sk=132), (256, 4096, 14336): WsTiles(256, 128, 4, 8, split=4)}
    assert table_from("256,4096,4096=ws_m128_n64_st6_w4_d4_r136_p0_km2") == {
        (256, 4096, 4096): WsTiles(128, 64, 6, 4, deq_regs=136, deq_parts=0, kmajor=2)}
    with pytest.raises(ValueError, match="not a warp-specialized"):
        table_from("256,1,1=swap t128 c128 w8 st5 a2")
    with pytest.raises(ValueError, match="bucket 200"):
        table_from("200,4096,4096=ws m128 n128 st4 w4 d4")


def test_routed_products_take_the_ws_gemm_and_read_x_natural(monkeypatch):
    """A product the ws table lists goes to `int4_ws_route.run` from `mma_matmul` (bf16, whole channel
    tiles; fp16 or a ragged N take the other paths), and `swap_route` says x stays natural for it
    even where the swapped GEMM's table lists the same shape."""
    from tokenmill.layers.quantization import int4_kperm
    from tokenmill.layers.quantization import int4_ws_route as ws
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot
    from tokenmill.layers.quantization import triton_int4_mma as mma

    t = ws.WsTiles(256, 128, 4, 8)
    monkeypatch.setattr(ws, "TABLE", {(256, 256, 512): t, (256, 272, 512): t})
    monkeypatch.setattr(dot, "TABLE", {(256, 256, 512): dot.SwapTiles(256, 8, 4)})
    assert ws.ws_tiles(200, 256, 512, 128, torch.bfloat16) == t
    assert ws.ws_tiles(200, 256, 512, 128, torch.float16) is None
    assert ws.ws_tiles(200, 272, 512, 128, torch.bfloat16) is None  # 272 channels: not tiles of 128
    assert ws.ws_tiles(100, 256, 512, 128, torch.bfloat16) is None  # bucket 128: not listed
    assert not int4_kperm.swap_route(200, 256, 512, 128, torch.bfloat16)
    assert int4_kperm.swap_route(200, 256, 512, 128, torch.float16) is False  # (the swap GEMM is bf16 only too)
    calls = []
    monkeypatch.setattr(ws, "run", lambda x, *a, **k: calls.append(a[-2]) or torch.zeros(x.shape[0], 256))
    _, qm, _, x = _case(256, 512, 128, m=200)
    mma.mma_matmul(x, qm, torch.ones(4, 256, dtype=torch.bfloat16), torch.zeros(4, 256, dtype=torch.bfloat16), 128)
    assert calls == [t]


@pytest.mark.parametrize("tiles,n_k,grid", [(224, 64, 132), (32, 224, 132), (48, 64, 132), (32, 64, 132), (3, 4, 132)])
def test_stream_k_segments_cover_every_step_once(tiles, n_k, grid):
    """The stream-K walk: every (tile, step) in exactly one CTA's range, in order; `cta_of` names the CTA
    holding a step, so slot c - cta_of(first step) is distinct per segment and below `max_segments`;
    a tile's segments, in slot order, are its whole K range."""
    pytest.importorskip("triton.experimental.gluon")
    from tokenmill.layers.quantization.gluon_int4_ws_streamk import (
        cta_of,
        max_segments,
        segments,
    )

    total = tiles * n_k
    grid = min(grid, total)  # as the wrapper: no CTA without a step (slots would not be contiguous)
    seen = []
    slots: dict[int, list[tuple[int, int, int]]] = {}
    for c, segs in enumerate(segments(tiles, n_k, grid)):
        for t, k0, k1 in segs:
            assert 0 <= k0 < k1 <= n_k
            seen += [t * n_k + k for k in range(k0, k1)]
            assert cta_of(t * n_k + k0, total, grid) == c and cta_of(t * n_k + k1 - 1, total, grid) == c
            slots.setdefault(t, []).append((c - cta_of(t * n_k, total, grid), k0, k1))
    assert seen == list(range(total))
    for segs in slots.values():
        assert [s for s, _, _ in segs] == list(range(len(segs))) and len(segs) <= max_segments(tiles, n_k, grid)
        assert segs[0][1] == 0 and segs[-1][2] == n_k and all(a[2] == b[1] for a, b in itertools.pairwise(segs))


def test_start_up_self_test_runs_the_ws_launches_and_switches_the_route_off(monkeypatch, caplog):
    """`int4.gemm_selftest` runs every launch `int4_ws_route.TABLE` lists (bf16) at its row tile and 3 rows
    more through `int4_ws_route.run`; a wrong or failing one switches the route off (`ENABLED`, logged)
    and `ws_tiles` then routes nothing."""
    from tokenmill.layers.quantization import int4
    from tokenmill.layers.quantization import int4_ws_route as ws
    from tokenmill.layers.quantization import int4_wsa_route as wsa
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot

    t = ws.WsTiles(128, 64, 6, 4, deq_regs=136, deq_parts=0, kmajor=1)
    for mod, name in ((dot, "TABLE"), (wsa, "TABLE"), (wsa, "PREFILL")):
        monkeypatch.setattr(mod, name, {})
    monkeypatch.setattr(ws, "TABLE", {(256, 4096, 4096): t})
    for mod in (dot, ws, wsa):
        monkeypatch.setattr(mod, "ENABLED", True)
    rows = []

    def exact(x, qm, scales, zeros, group, tiles, counters=None):  # the product as the kernel must give it
        rows.append((x.shape[0], tiles))
        w = packing.dequantize(packing.Int4Weights(packing.from_mma(qm), scales, zeros, None), group, torch.float32)
        return (x.float() @ w).to(x.dtype)

    for run, ok in ((exact, True), (lambda *a, **k: exact(*a, **k) * 1.05, False),
                    (lambda *a, **k: (_ for _ in ()).throw(RuntimeError("CompilationError")), False)):
        monkeypatch.setattr(int4, "_GEMM_SELFTEST", {})
        monkeypatch.setattr(ws, "ENABLED", True)
        monkeypatch.setattr(ws, "run", run)
        with caplog.at_level("WARNING"):
            assert int4.gemm_selftest(torch.device("cpu"), torch.bfloat16) is ok
        assert ws.ENABLED is ok and (ws.ws_tiles(256, 4096, 4096, 128, torch.bfloat16) == t) is ok
    assert rows[:2] == [(128, t), (131, t)] and "self-test" in caplog.text
