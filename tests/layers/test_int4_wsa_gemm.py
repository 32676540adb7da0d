"""The warp-specialized swapped Gluon INT4 GEMM (`gluon_int4_wsa_gemm`: a TMA loader warp, consumer
warpgroups dequantizing the weight in registers as wgmma's A operand). Gluon has no interpreter, so the
CPU checks its parts: what a ring slot holds as the consumers read it (`slot_tiles`: the loader's TMA
coordinates and the plain views) through the swapped GEMM's register map, the split-K slice order
(`emulate`) against a float64 reference from the codes, the stream-K walk (`segments`, `cta_of`), both
wrappers' refusals, the launch labels and table, the route (one table lookup a call), and offline sm_90
compiles (HGMMA with A in registers, one wgmma left in flight, only the consumers' own barrier in the
loop, three TMA loads, no local memory).
On a GPU scripts/gpu_int4_wsa.py checks every launch against a float32 reference.
"""

from __future__ import annotations

import itertools
import os
import re

import pytest
import torch

from tests.helpers.int4_gemm import case, compile_gluon_sm90, reference_w
from tests.helpers.requirements import require_module

require_module("triton")  # skipped on a machine without it; in CI, missing fails

_PTRS = {"out_ptr": "bf16", "part_ptr": "fp32", "cnt_ptr": "i32"}


def _descs(bt: int, bc: int) -> dict:
    """The wsa kernels' TMA descriptor types for [bt, 64] x tiles and bc-channel word / scale tiles."""
    from triton.experimental.gluon import language as gl

    from tokenmill.layers.quantization.gluon_int4_wsa_gemm import _PLAIN32

    lay = gl.NVMMASharedLayout.get_default_for([bt, 64], gl.bfloat16)
    return {"x_desc": f"tensordesc<bf16[{bt}, 64],{lay!r}>", "w_desc": f"tensordesc<i32[{bc // 16}, 128],{_PLAIN32!r}>",
            "s_desc": f"tensordesc<i32[1, {bc}],{_PLAIN32!r}>"}


@pytest.mark.parametrize("wgs,split,group", [(1, 1, 128), (2, 2, 64), (2, 4, 128), (4, 2, 128)])
def test_emulated_product_matches_float64_reference(wgs, split, group):
    """The slots' words and scales (as the loader places them and the consumers view them) through the
    swapped GEMM's register map, times x permuted, summed over the K slices in order, is x @ W^T
    within bf16 rounding (a wrong TMA coordinate, view, scale half or group fails)."""
    pytest.importorskip("triton.experimental.gluon")
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import permute_x
    from tokenmill.layers.quantization.gluon_int4_wsa_gemm import emulate
    from tokenmill.layers.quantization.int4_wsa_route import WsaTiles

    codes, qm, sz, x = case(512 if wgs == 4 else 256, 512, group, m=40)
    ref = x.double() @ reference_w(codes)
    out = emulate(permute_x(x), qm, sz, group, WsaTiles(bt=64 if wgs == 4 else 128, wgs=wgs), split=split)
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < 4e-3, err


def test_slot_weights_are_the_weights_rounded_once():
    """Element for element: a slot's dequantized A tile (logical K order) is the float64 weight rounded
    once to bf16 at the inputs `permute_x` puts in those columns."""
    pytest.importorskip("triton.experimental.gluon")
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import (
        fragment_tile,
        permute_x,
    )
    from tokenmill.layers.quantization.gluon_int4_wsa_gemm import slot_tiles

    codes, qm, sz, _ = case(128, 256, 64)
    ref = reference_w(codes).t().to(torch.bfloat16).double()  # [N, K]
    for step in range(4):
        cols = permute_x(torch.arange(256.0).reshape(1, 256))[0, step * 64:(step + 1) * 64].long()
        for pid_c in range(2):
            words, lo, hi = slot_tiles(qm, sz, step, pid_c, 64, 64)
            for b in range(4):
                q = fragment_tile(words.reshape(4, 1, 32, 4), 0, b).double()
                rows = slice(pid_c * 64 + 16 * b, pid_c * 64 + 16 * b + 16)
                sc = torch.cat([lo[b], hi[b]]) & 0xFFFF
                mz = (torch.cat([lo[b], hi[b]]) >> 16) & 0xFFFF
                sc = ((sc ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16).double()
                mz = ((mz ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16).double()
                w = ((q + 128 - mz[:, None]) * sc[:, None]).to(torch.bfloat16).double()
                assert torch.equal(w, ref[rows][:, cols]), (step, pid_c, b)


@pytest.mark.parametrize("tiles_t,tiles_c,raster", [(1, 224, 0), (32, 224, 0), (32, 224, 8), (33, 7, 8), (5, 3, 2)])
def test_cta_order_covers_every_tile_once(tiles_t, tiles_c, raster):
    """The CTA -> (token tile, channel tile) order (`cta_tile`, the kernel's formula) is a bijection of the
    grid onto the tiles, a partial last group included; with a raster, consecutive CTAs of a group share
    its token tiles."""
    pytest.importorskip("triton.experimental.gluon")
    from tokenmill.layers.quantization.gluon_int4_wsa_gemm import cta_tile

    got = [cta_tile(p, tiles_t, tiles_c, raster) for p in range(tiles_t * tiles_c)]
    assert sorted(got) == [(t, c) for t in range(tiles_t) for c in range(tiles_c)]
    if raster:
        assert {t for t, _ in got[:raster * tiles_c]} == set(range(min(raster, tiles_t)))


def test_wrapper_refuses_what_the_kernel_cannot_do():
    """fp16 x, N not a multiple of the CTA's channels, a group not of 64, an odd number of steps:
    ValueError before any launch (so on the CPU)."""
    pytest.importorskip("triton.experimental.gluon")
    from tokenmill.layers.quantization.gluon_int4_wsa_gemm import wsa_gemm
    from tokenmill.layers.quantization.int4_wsa_route import WsaTiles

    _, qm, sz, x = case(128, 256, 64)
    scales = torch.ones(4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 x"):
        wsa_gemm(x.half(), qm, scales, scales, 64, sz=sz)
    with pytest.raises(ValueError, match="N a multiple of 256"):
        wsa_gemm(x, qm, scales, scales, 64, WsaTiles(wgs=2, cpw=2), sz=sz)
    with pytest.raises(ValueError, match="group"):
        wsa_gemm(x, qm, scales, scales, 96, sz=sz)
    _, qm3, sz3, x3 = case(128, 192, 64)
    with pytest.raises(ValueError, match="even number"):
        wsa_gemm(x3, qm3, scales, scales, 64, sz=sz3)


def test_stream_k_wrapper_refuses_what_the_kernel_cannot_do():
    """The stream-K wrapper shares the plain one's checks (`checked_shape`; an odd number of steps is
    fine for it: a segment may be one step) and refuses sk 0 or fewer counters than output tiles."""
    pytest.importorskip("triton.experimental.gluon")
    from tokenmill.layers.quantization.gluon_int4_wsa_streamk import wsa_streamk_gemm
    from tokenmill.layers.quantization.int4_wsa_route import WsaTiles

    _, qm, sz, x = case(128, 256, 64)
    scales = torch.ones(4, 128, dtype=torch.bfloat16)
    t = WsaTiles(128, 2, 1, 6, sk=132)
    counters = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="stream-K int4 GEMM: bf16 x"):
        wsa_streamk_gemm(x.half(), qm, scales, scales, 64, t, counters, sz=sz)
    with pytest.raises(ValueError, match="N a multiple of 256"):
        wsa_streamk_gemm(x, qm, scales, scales, 64, WsaTiles(wgs=2, cpw=2, sk=132), counters, sz=sz)
    with pytest.raises(ValueError, match="group"):
        wsa_streamk_gemm(x, qm, scales, scales, 96, t, counters, sz=sz)
    with pytest.raises(ValueError, match="sk >= 1"):
        wsa_streamk_gemm(x, qm, scales, scales, 64, WsaTiles(128, 2, 1, 6), counters, sz=sz)
    with pytest.raises(ValueError, match="1 counters for 2 tiles"):
        wsa_streamk_gemm(torch.cat([x] * 6), qm, scales, scales, 64, t, counters, sz=sz)


@pytest.mark.parametrize("tiles,n_k,grid", [(224, 64, 132), (32, 224, 132), (48, 64, 132), (32, 64, 132), (3, 4, 132)])
def test_stream_k_segments_cover_every_step_once(tiles, n_k, grid):
    """The stream-K walk: every (tile, step) in exactly one CTA's range, in order; `cta_of` names the CTA
    holding a step, so slot c - cta_of(first step) is distinct per segment and below `max_segments`;
    a tile's segments, in slot order, are its whole K range."""
    pytest.importorskip("triton.experimental.gluon")
    from tokenmill.layers.quantization.gluon_int4_wsa_streamk import (
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


def test_split_is_whole_even_slices_and_follows_the_counters():
    """split-K only with a counter per output tile, lowered until each slice holds an even number of steps."""
    pytest.importorskip("triton.experimental.gluon")
    from tokenmill.layers.quantization.gluon_int4_wsa_gemm import split_for
    from tokenmill.layers.quantization.int4_wsa_route import WsaTiles

    c = torch.zeros(64, dtype=torch.int32)
    assert split_for(WsaTiles(split=4), 4096, 32, c) == 4
    assert split_for(WsaTiles(split=4), 4096, 65, c) == 1
    assert split_for(WsaTiles(split=4), 4096, 32, None) == 1
    assert split_for(WsaTiles(split=4), 64 * 12, 8, c) == 3  # 12 steps: 3 slices of 4
    assert split_for(WsaTiles(split=4), 64 * 14, 8, c) == 1  # 14 steps: 2 slices of 7 are odd
    assert split_for(WsaTiles(split=4), 14336, 32, c) == 4  # down: 224 steps, 56 a slice


def test_labels_parse_back_and_the_table_reads_the_environment_form():
    """`WsaTiles.parse` inverts `label`; TOKENMILL_INT4_WSA_TABLE's form becomes TABLE entries; a bad
    label or a bucket the engine does not use is refused."""
    from tokenmill.layers.quantization.int4_wsa_route import WsaTiles, table_from

    for t in (WsaTiles(), WsaTiles(128, 1, 1, 6), WsaTiles(256, 2, 1, 4, 4), WsaTiles(64, 2, 2, 5, 2),
              WsaTiles(128, 2, 1, 6, sk=132), WsaTiles(256, 2, 1, 4, 2, depth=2), WsaTiles(128, 2, 1, 6, sk=132, depth=2),
              WsaTiles(256, 2, 1, 4, raster=8), WsaTiles(256, 2, 1, 4, depth=2, raster=4)):
        assert WsaTiles.parse(t.label()) == t, t.label()
    got = table_from("256,28672,4096=wsa t256 g2 c1 st4; 256,4096,14336=wsa t256 g2 c1 st4 s4;")
    assert got == {(256, 28672, 4096): WsaTiles(256, 2, 1, 4), (256, 4096, 14336): WsaTiles(256, 2, 1, 4, 4)}
    with pytest.raises(ValueError, match="not a warp-specialized swapped"):
        table_from("256,1,1=ws m256 n128 st4 w8 d4")
    with pytest.raises(ValueError, match="bucket 200"):
        table_from("200,4096,4096=wsa t256 g2 c1 st4")
    from tokenmill.layers.quantization.int4_wsa_route import prefill_from

    assert prefill_from("28672,4096=wsa t256 g2 c1 st4 r8; 4096,14336=wsa t256 g2 c1 st4 r2") == {
        (28672, 4096): WsaTiles(256, 2, 1, 4, raster=8), (4096, 14336): WsaTiles(256, 2, 1, 4, raster=2)}
    with pytest.raises(ValueError, match="not a warp-specialized swapped"):
        prefill_from("28672,4096=swap t128 c128 w8 st5 a2")


def test_routed_products_take_the_wsa_gemm_on_permuted_x(monkeypatch):
    """A product the wsa table lists (bf16, whole channel tiles, even steps) is one the producers write
    permuted (`swap_route`), and `mma_matmul` runs it through `int4_wsa_route.run` on that x as it is,
    or on x permuted by the wrapper when given natural x; fp16 / ragged N / an unlisted bucket do not."""
    from tokenmill.layers.quantization import int4_kperm
    from tokenmill.layers.quantization import int4_wsa_route as wsa
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot
    from tokenmill.layers.quantization import triton_int4_mma as mma

    t = wsa.WsaTiles(256, 2, 1, 4)
    monkeypatch.setattr(wsa, "TABLE", {(256, 256, 512): t, (256, 320, 512): t})
    monkeypatch.setattr(dot, "TABLE", {})
    assert wsa.wsa_tiles(200, 256, 512, 128, torch.bfloat16) == t
    assert wsa.wsa_tiles(200, 256, 512, 128, torch.float16) is None
    assert wsa.wsa_tiles(200, 320, 512, 128, torch.bfloat16) is None  # 320 channels: not tiles of 128
    assert wsa.wsa_tiles(100, 256, 512, 128, torch.bfloat16) is None  # bucket 128: not listed
    assert wsa.wsa_tiles(8192, 256, 512, 128, torch.bfloat16) is None  # past the buckets: PREFILL, empty
    monkeypatch.setattr(wsa, "PREFILL", {(256, 512): t})
    assert wsa.wsa_tiles(8192, 256, 512, 128, torch.bfloat16) == t and wsa.wsa_tiles(1025, 256, 512, 128, torch.bfloat16) == t
    assert wsa.wsa_tiles(1024, 256, 512, 128, torch.bfloat16) is None  # bucket 1024: TABLE's
    assert int4_kperm.swap_route(8192, 256, 512, 128, torch.bfloat16)
    monkeypatch.setattr(wsa, "PREFILL", {})
    assert int4_kperm.swap_route(200, 256, 512, 128, torch.bfloat16)
    assert not int4_kperm.swap_route(200, 256, 512, 128, torch.float16)
    calls = []
    monkeypatch.setattr(wsa, "run", lambda x, *a, **k: calls.append((a[-2], x.clone())) or torch.zeros(x.shape[0], 256))
    _, qm, _, x = case(256, 512, 128, m=200)
    ones, zeros = torch.ones(4, 256, dtype=torch.bfloat16), torch.zeros(4, 256, dtype=torch.bfloat16)
    mma.mma_matmul(x, qm, ones, zeros, 128, x_kperm=True)
    mma.mma_matmul(x, qm, ones, zeros, 128)
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import permute_x

    assert [c[0] for c in calls] == [t, t]
    assert torch.equal(calls[0][1], x) and torch.equal(calls[1][1], permute_x(x))
    lookups = []
    real = wsa.wsa_tiles
    monkeypatch.setattr(wsa, "wsa_tiles", lambda *a: lookups.append(a) or real(*a))
    mma.mma_matmul(x, qm, ones, zeros, 128, x_kperm=True)  # one table lookup a call, x permuted or not
    mma.mma_matmul(x, qm, ones, zeros, 128)
    assert len(lookups) == 2 and len(calls) == 4


# the call sites that may run while the wgmmas of others are in flight (their A registers must differ):
# depth 1: step 0, the loop's pair, the odd last one; depth 2: two heads, the loop's triple, two tails
_IN_FLIGHT = {1: ((0, 1), (1, 2), (2, 3), (0, 3)),
              2: ((0, 1), (0, 2), (1, 2), (2, 3), (2, 4), (3, 4), (1, 3), (1, 5), (0, 5), (4, 5), (3, 5), (5, 6),
                  (1, 6), (4, 6))}


@pytest.mark.parametrize("bt,wgs,split,depth", [(256, 2, False, 1), (128, 1, True, 1), (256, 2, False, 2),
                                                 (64, 4, True, 1), (64, 4, False, 1), (64, 2, True, 1), (32, 4, False, 1)])
def test_compiles_for_sm90_warp_specialized(bt, wgs, split, depth):
    """Offline sm_90 compile (no GPU): per step and warpgroup 4 HGMMA 64 x BT x 16 with A in registers
    (depth 1: four call sites, depth 2: seven), `depth` left in flight (DEPBAR.LE gsb0, depth; 0x0 only
    after the loop: ptxas did not serialize them), the A registers of call sites that may follow one
    another disjoint, between the first HGMMA and the final wait no barrier but the consumers' own
    (BAR.SYNC 0x0 over their 32 x 4 wgs threads), one-thread mbarrier arrives, three TMA loads (x,
    words, scales), no global load outside split-K's epilogue, the loader's registers handed over, no
    local memory (split-K's epilogue: one spilled word at most)."""
    pytest.importorskip("triton.experimental.gluon")
    from tokenmill.layers.quantization.gluon_int4_wsa_gemm import _wsa_gemm_kernel as fn

    const = {"GROUP": 128, "STAGES": 4, "SPLIT_K": split, "DEPTH": depth, "RASTER": 8 if depth == 2 else 0}
    fig, sass = compile_gluon_sm90(fn, const, _PTRS, _descs(bt, 64 * wgs), aligned=("N", "K", "s_om"),
                                   num_warps=4 * wgs)
    assert fig["stack"] <= (8 if split else 0), fig
    hgmma = re.findall(rf"HGMMA\.64x{bt}x16\.F32\.BF16 R\d+, (\S+), gdesc", sass)
    sites = 4 if depth == 1 else 7
    assert len(hgmma) == 4 * sites and all(a.startswith("R") for a in hgmma), hgmma  # A from registers
    regs = [{int(a[1:]) for a in hgmma[4 * j:4 * j + 4]} for j in range(sites)]
    assert all(regs[a].isdisjoint(regs[b]) for a, b in _IN_FLIGHT[depth]), regs
    lines = sass.splitlines()
    first = next(i for i, s in enumerate(lines) if "HGMMA" in s)
    last = next(i for i, s in enumerate(lines) if "DEPBAR.LE gsb0, 0x0" in s)
    loop = lines[first:last]
    assert any(f"WARPGROUP.DEPBAR.LE gsb0, {hex(depth)}" in s for s in loop)
    assert not any("DEPBAR.LE gsb0, 0x0" in s for s in loop)
    bars = [s for s in loop if "BAR.SYNC" in s]
    assert bars and all(f"BAR.SYNC.DEFER_BLOCKING 0x0, {hex(128 * wgs)} ;" in s for s in bars), bars
    assert any("SYNCS.ARRIVE.TRANS64.A1T0" in s for s in loop)
    assert sass.count("UTMALDG.2D") == 3
    if not split:
        assert not re.findall(r"(?<![A-Z])LDG[.A-Z0-9]*", sass)
    assert "USETMAXREG.DEALLOC" in sass


def test_stream_k_compiles_for_sm90():
    """The stream-K kernel (t128 g2: per segment step 0, the pairs' two call sites and an odd last one):
    HGMMA with A in registers (4 call sites x 4), one left in flight, the call sites' A registers
    disjoint where one follows another, a whole tile's bf16 store and the partials' reduce, no local
    memory."""
    pytest.importorskip("triton.experimental.gluon")
    from tokenmill.layers.quantization.gluon_int4_wsa_streamk import (
        _wsa_streamk_kernel as fn,
    )

    fig, sass = compile_gluon_sm90(fn, {"GROUP": 128, "STAGES": 6, "DEPTH": 1}, _PTRS, _descs(128, 128),
                                   aligned=("N", "K", "s_om"), num_warps=8)
    assert fig["stack"] == 0, fig
    hgmma = re.findall(r"HGMMA\.64x128x16\.F32\.BF16 R\d+, (\S+), gdesc", sass)
    assert len(hgmma) == 16 and all(a.startswith("R") for a in hgmma), hgmma
    sites = [{int(a[1:]) for a in hgmma[4 * j:4 * j + 4]} for j in range(4)]
    assert all(sites[a].isdisjoint(sites[b]) for a, b in ((0, 1), (1, 2), (2, 3), (0, 3))), sites
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass
    assert sass.count("UTMALDG.2D") == 3 and "ATOMG" in sass


@pytest.mark.parametrize("right", [True, False])
def test_engine_selftest_checks_the_wsa_launches(monkeypatch, right):
    """`int4.gemm_selftest` runs every launch the wsa table lists on x permuted against the float32
    reference: a right product keeps the route, a wrong one switches it off (with the other GEMMs)."""
    from tokenmill.layers.quantization import int4
    from tokenmill.layers.quantization import int4_packing as pk
    from tokenmill.layers.quantization import int4_wsa_route as wsa
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot
    from tokenmill.layers.quantization.int4_kperm import unpermute

    t = wsa.WsaTiles(128, 2, 1, 6, sk=132)
    monkeypatch.setattr(wsa, "TABLE", {(256, 4096, 4096): t})
    monkeypatch.setattr(wsa, "PREFILL", {(4096, 4096): wsa.WsaTiles(256, 2, 1, 4, raster=8)})
    monkeypatch.setattr(dot, "TABLE", {})
    for mod in (wsa, dot):
        monkeypatch.setattr(mod, "ENABLED", True)
    monkeypatch.setattr(int4, "_GEMM_SELFTEST", {})
    seen = []

    def fake(xp, qm, scales, zeros, group, tiles, counters):
        seen.append((xp.shape[0], tiles))
        out = unpermute(xp).float() @ pk.dequantize(pk.Int4Weights(qm, scales, zeros, None),
                                                    group, torch.float32)
        return out if right else out + 1.0

    monkeypatch.setattr(wsa, "run", fake)
    assert int4.gemm_selftest(torch.device("cpu"), torch.bfloat16) is right
    r8 = wsa.WsaTiles(256, 2, 1, 4, raster=8)
    assert seen == [(128, t), (125, t), (256, r8), (253, r8)] and wsa.ENABLED is right


def test_bench_pick_replaces_only_entries_beaten_by_the_margin(tmp_path):
    """scripts/gpu_int4_wsa.py --pick (the table a request's end-to-end run takes): an entry is replaced by
    the fastest launch of its linear only where that beat the entry's own launch by more than 2%; others
    (a near tie, the bf16 / routed columns, a linear not timed) keep DEFAULT_TABLE's launch."""
    import json
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    import gpu_int4_wsa

    from tokenmill.layers.quantization.int4_wsa_route import DEFAULT_TABLE, table_from

    default = table_from(DEFAULT_TABLE)
    own = {name: default[(256, n, k)].label() for name, (n, k) in gpu_int4_wsa.LLAMA.items()}
    us = {"m256/down": {"bf16": 1.0, own["down"]: 50.0, "wsa t64 g4 c1 st6 s2": 49.5},  # within 2%: kept
          "m256/qkv": {"bf16": 1.0, own["qkv"]: 27.0, "wsa t64 g4 c1 st6": 22.0, "wsa t32 g4 c1 st8": 23.0},
          "m256/o": {"routed": 1.0, own["o"]: 24.0}}  # no wsa launch faster: kept
    (tmp_path / "int4wsa-bench.json").write_text(json.dumps({"us": us}))
    got = table_from(gpu_int4_wsa.pick(str(tmp_path)))
    assert got == table_from((tmp_path / "table.txt").read_text())
    want = dict(default)
    want[(256, 6144, 4096)] = table_from("256,6144,4096=wsa t64 g4 c1 st6")[(256, 6144, 4096)]
    assert got == want, got
