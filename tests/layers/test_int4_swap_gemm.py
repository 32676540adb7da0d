"""The swapped Gluon INT4 GEMM (`gluon_int4_swap_gemm`: the weight dequantized into wgmma's register A
operand, x with its columns in the mma layout's K order). Gluon has no interpreter, so the CPU checks
its parts: the K order and register map (`permute_x`, `fragment_tile`, through `emulate`) against a
float64 reference, its PTX dequantization through the emulator of tests/layers/test_int4_dot_gemm.py,
the index algebra of the kernel's join / permute against `fragment_tile`, and an offline sm_90 compile
(register-A wgmmas left in flight, two register sets in the loop, no local memory). On a GPU
scripts/gpu_int4_gemm.py (INT4_GEMM_SET=swap) checks every timed launch against a float32 reference.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton permute; the sm_90 compile test is offline

import re

import pytest
import torch

from tests.helpers.int4_gemm import compile_gluon_sm90
from tests.helpers.requirements import require_module
from tokenmill.layers.quantization import int4_packing as packing

require_module("triton")  # skipped on a machine without it; in CI, missing fails


def _case(n=64, k=256, group=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = packing.quantize_int4(torch.randn(n, k, generator=g), group, sym=False)
    return packing.from_codes(codes, torch.float32, act_order=False)


def test_table_takes_swap_tiles_where_they_fit(monkeypatch):
    """`dot_tiles` hands a listed SwapTiles launch to bf16 products whose N fills its channel tiles
    and whose K holds an even number of steps; fp16, a ragged N or an odd step count get None."""
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot

    t = dot.SwapTiles(256, 8, 4)
    monkeypatch.setattr(dot, "ENABLED", True)
    monkeypatch.setattr(dot, "TABLE", {(256, 256, 512): t, (256, 272, 512): t, (256, 256, 576): t})
    assert dot.dot_tiles(200, 256, 512, 128) == t
    assert dot.dot_tiles(200, 256, 512, 128, torch.float16) is None
    assert dot.dot_tiles(200, 272, 512, 128) is None  # 272 channels: not tiles of 128
    assert dot.dot_tiles(200, 256, 576, 64) is None  # 9 steps of 64


@pytest.mark.parametrize("n,k,group", [(64, 256, 64), (32, 512, 128)])
def test_emulated_product_matches_reference(n, k, group):
    """The fragment map times x in the permuted K order is x @ W^T (a wrong K order or map fails)."""
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import emulate

    wt = _case(n, k, group)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = x @ packing.dequantize(wt, group, torch.float64)
    out = emulate(x, packing.to_mma(wt.qweight), wt.scales, wt.zeros, group)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)  # the reference dequantizes in float32


def test_permute_x_is_a_permutation_within_steps():
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import permute_x

    x = torch.arange(2 * 128, dtype=torch.float32).view(2, 128)
    xp = permute_x(x)
    assert sorted(xp[0, :64].tolist()) == list(range(64)) and sorted(xp[1, 64:].tolist()) == list(range(192, 256))
    # logical column 16 m + 8 a + 2 j + b holds input 16 j + 4 m + 2 a + b
    assert xp[0, 16 * 1 + 8 * 1 + 2 * 2 + 1].item() == 16 * 2 + 4 * 1 + 2 * 1 + 1


def test_gathered_x_columns_are_the_permutation():
    """The kernel's in-place gather (xnat) reads, column by column, what `permute_x` would hold."""
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import (
        gather_columns,
        permute_x,
    )

    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    assert torch.equal(x[:, gather_columns(128)], permute_x(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k,block_r,block_k", [(5, 128, 8, 64), (19, 320, 8, 128), (3, 1024, 2, 512)])
def test_triton_permute_matches_view_permute(m, k, block_r, block_k, dtype):
    """`triton_x_permute` (interpreted) equals the view permute, with rows and columns that do not
    fill a block."""
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import permute_x
    from tokenmill.layers.quantization.triton_x_permute import permute_x_triton

    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    assert torch.equal(permute_x_triton(x, block_r, block_k), permute_x(x))


def test_kernel_join_permute_builds_the_fragment_tile():
    """The kernel's `_dequant` index algebra (join of the word with itself, four outputs joined
    (hi, a), permute `A_ORDER`, reshape) mirrored on codes gives `fragment_tile`."""
    from tokenmill.layers.quantization import gluon_int4_swap_gemm as sw

    qm = packing.to_mma(_case(32, 128).qweight)
    words = qm[:, 0].to(torch.int64).view(2, 1, 8, 4, 4)  # [CB, S2, g, j, m]
    w2 = torch.stack([words, words], dim=-1)  # gl.join(words, words)
    shifts = torch.tensor([0, 16])  # element b of output k: nibble k + 4 b (the PTX's halves)
    o = [(w2 >> (4 * k + shifts)) & 0xF for k in range(4)]
    v = torch.stack([torch.stack([o[0], o[1]], -1), torch.stack([o[2], o[3]], -1)], -1)
    a = v.permute(*sw.A_ORDER.value).reshape(32, 64)
    for cb in range(2):
        assert torch.equal(a[16 * cb:16 * cb + 16], sw.fragment_tile(qm, 0, cb))


def test_ptx_dequantization_emulated():
    """$k of the PTX: nibbles k (low half) and k + 4 of the word, channel g (even k) or g + 8 (odd),
    each (q - z) * s rounded once in bf16."""
    from tests.layers.test_int4_dot_gemm import _half16, _run_ptx
    from tokenmill.layers.quantization import gluon_int4_swap_gemm as sw
    from tokenmill.layers.quantization.triton_int4_dot_gemm import packed_scale_offset

    asm = sw._ASM_SWAP.value.replace("$", "r")
    g = torch.Generator().manual_seed(3)
    for trial in range(6):
        word = torch.randint(0, 1 << 32, (1,), generator=g, dtype=torch.int64).item()
        scales = (torch.rand(2, generator=g) * 0.1 + 0.001).to(torch.bfloat16)  # channel g, g + 8
        zeros = torch.randint(0, 16, (2,), generator=g)
        sz = packed_scale_offset(scales[None], zeros[None].to(torch.bfloat16))[0].to(torch.int64) & 0xFFFFFFFF
        s2, z2 = sw.scale_pairs(sz)
        regs = {"r4": word, "r5": word, "r6": s2[0].item(), "r8": z2[0].item(), "r10": s2[1].item(),
                "r12": z2[1].item()}
        out = _run_ptx(asm, regs, torch.bfloat16)
        for k in range(4):
            for b in range(2):
                q = (word >> (4 * (k + 4 * b))) & 0xF
                ch = k % 2
                want = torch.tensor([(q - zeros[ch].item()) * scales[ch].item()], dtype=torch.float64)
                got = _half16((out[f"r{k}"] >> (16 * b)) & 0xFFFF, torch.bfloat16)
                assert got == want.to(torch.bfloat16).item(), (trial, k, b)


@pytest.mark.parametrize("wtop,ahead,bt", [(0, 2, 256), (1, 2, 256), (0, 3, 128), (1, 4, 128)])
def test_compiles_for_sm90_with_wgmma_in_flight(wtop, ahead, bt):
    """Offline sm_90 compile (no GPU): register-A HGMMAs, the loop's wgmma left in flight
    (`WARPGROUP.DEPBAR.LE gsb0, 0x1`), the loop's two call sites dequantizing into disjoint
    registers (the wgmma in flight reads the other set), no local memory; the deeper word prefetch
    (AHEAD 3, 4: the loads of 4, 5 steps in flight) included."""
    pytest.importorskip("triton.experimental.gluon")
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import (
        _swap_gemm_kernel as fn,
    )

    const = {"GROUP": 128, "BT": bt, "BK": 64, "STAGES": 4 + wtop, "AHEAD": ahead, "SPLIT_K": False,
             "XNAT": False, "CPW": 1, "WTOP": wtop}
    ptrs = {"x_ptr": "bf16", "w_ptr": "i32", "sz_ptr": "i32", "out_ptr": "bf16", "part_ptr": "fp32", "cnt_ptr": "i32"}
    fig, sass = compile_gluon_sm90(fn, const, ptrs, aligned=("N", "K", "s_xm", "s_om"), num_warps=8)
    assert fig["stack"] == 0, fig
    hgmma = re.findall(rf"HGMMA\.64x{bt}x16\.F32\.BF16 R\d+, (R\d+), gdesc", sass)
    assert len(hgmma) == 16, hgmma  # 4 k16 steps x (peeled step, two loop call sites, last step)
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass
    if wtop:  # two steps' wgmmas in flight at the end of a step
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x2" in sass
    # A register sets in program order: peel, loop site 1, loop site 2, last step
    sets = [set(hgmma[4 * i:4 * i + 4]) for i in range(4)]
    assert sets[1].isdisjoint(sets[2]), sets


def test_launch_labels_parse_back_and_override_the_table(monkeypatch):
    """`SwapTiles.parse` inverts `label` (TOKENMILL_INT4_GEMM_TABLE names launches by label);
    `table_override` replaces or removes entries and refuses a label it cannot read."""
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot

    S = dot.SwapTiles
    for t in (S(256, 8, 4), S(128, 8, 5, 2, 64, 3, False, 1, True), S(128, 4, 4, 1, 64, 4), S(64, 4, 4, 4, 64, 2, True),
              S(128, 8, 4, 1, 64, 1, False, 2), S(256, 8, 4, 1, 128, 2)):
        assert S.parse(t.label()) == t, t.label()
    got = dot.table_override("256,4096,14336=swap t128 c128 w8 st5 s2 a3 wt; 256,4096,4096=none;")
    assert got == {(256, 4096, 14336): S(128, 8, 5, 2, 64, 3, False, 1, True), (256, 4096, 4096): None}
    with pytest.raises(ValueError, match="not a swapped GEMM launch"):
        dot.table_override("256,1,1=dot m64 n128")
