"""Offline (no GPU): the sm_90 SASS of this tree's INT4 Gluon GEMM kernels (wsa, stream-K, swapped) against
another tree's copies of their modules, for a clean-up that must not change the generated code (session 12:
the shared epilogue and split-K reduction). The other tree's modules sit in a package OLD on PYTHONPATH
(their imports of each other rewritten to it, as scripts/gpu_int4_bitab.py takes them); kernel names
aside, the SASS and the resource figures must be equal. A control compiles two different launches (they
must differ: the comparison can tell). The plain Gluon GEMM (`gluon_int4_gemm`) uses a cp.async name
newer Tritons dropped: it compiles only on the GPU's Triton (gpu_int4_bitab.py checks it there).

    PYTHONPATH=/path/with/old python scripts/int4_gluon_sass_ab.py [OLD] [NAME_FILTER...]

Exit status: the number of launches whose SASS differs (the control failing to differ counts too).
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.helpers.int4_gemm import compile_gluon_sm90  # after the path

_NAMES = re.compile(r"_wsa_gemm_kernel|_wsa_streamk_kernel|_swap_gemm_kernel")
_PTRS = {"out_ptr": "bf16", "part_ptr": "fp32", "cnt_ptr": "i32"}


def _norm(sass: str) -> str:
    return "\n".join(line for line in _NAMES.sub("K", sass).splitlines()
                     if "Function" not in line and ".section" not in line)


def _descs(bt: int, bc: int) -> dict:
    from triton.experimental.gluon import language as gl

    from tokenmill.layers.quantization.gluon_int4_wsa_gemm import _PLAIN32
    lay = gl.NVMMASharedLayout.get_default_for([bt, 64], gl.bfloat16)
    return {"x_desc": f"tensordesc<bf16[{bt}, 64],{lay!r}>", "w_desc": f"tensordesc<i32[{bc // 16}, 128],{_PLAIN32!r}>",
            "s_desc": f"tensordesc<i32[1, {bc}],{_PLAIN32!r}>"}


def wsa(mod, bt, wgs, split, depth, raster, stages=4):
    const = {"GROUP": 128, "STAGES": stages, "SPLIT_K": split, "DEPTH": depth, "RASTER": raster}
    return compile_gluon_sm90(mod._wsa_gemm_kernel, const, _PTRS, _descs(bt, 64 * wgs), aligned=("N", "K", "s_om"),
                              num_warps=4 * wgs)


def streamk(mod, bt, wgs, depth, stages=6):
    return compile_gluon_sm90(mod._wsa_streamk_kernel, {"GROUP": 128, "STAGES": stages, "DEPTH": depth}, _PTRS,
                              _descs(bt, 64 * wgs), aligned=("N", "K", "s_om"), num_warps=4 * wgs)


def swap(mod, bt, split, ahead, wtop, xnat=False):
    const = {"GROUP": 128, "BT": bt, "BK": 64, "STAGES": 4 + wtop, "AHEAD": ahead, "SPLIT_K": split,
             "XNAT": xnat, "CPW": 1, "WTOP": wtop}
    ptrs = {"x_ptr": "bf16", "w_ptr": "i32", "sz_ptr": "i32", **_PTRS}
    return compile_gluon_sm90(mod._swap_gemm_kernel, const, ptrs, aligned=("N", "K", "s_xm", "s_om"), num_warps=8)


# (name, module, compile(mod), control: compile(mod) of another launch, for the control row only)
CASES = [
    ("wsa t256 g2 st5", "gluon_int4_wsa_gemm", lambda m: wsa(m, 256, 2, False, 1, 0, 5)),
    ("wsa t256 g1 st6 s2", "gluon_int4_wsa_gemm", lambda m: wsa(m, 256, 1, True, 1, 0, 6)),
    ("wsa t128 g2 st6", "gluon_int4_wsa_gemm", lambda m: wsa(m, 128, 2, False, 1, 0, 6)),
    ("wsa t64 g2 st6", "gluon_int4_wsa_gemm", lambda m: wsa(m, 64, 2, False, 1, 0, 6)),
    ("wsa t256 g2 st4 r8", "gluon_int4_wsa_gemm", lambda m: wsa(m, 256, 2, False, 1, 8)),
    ("wsa t256 g2 st4 s2 d2 r8", "gluon_int4_wsa_gemm", lambda m: wsa(m, 256, 2, True, 2, 8)),
    ("wsa t128 g2 st6 sk", "gluon_int4_wsa_streamk", lambda m: streamk(m, 128, 2, 1)),
    ("swap t256 a2", "gluon_int4_swap_gemm", lambda m: swap(m, 256, False, 2, 0)),
    ("swap t128 s a3 wt", "gluon_int4_swap_gemm", lambda m: swap(m, 128, True, 3, 1)),
    ("swap t128 s xnat", "gluon_int4_swap_gemm", lambda m: swap(m, 128, True, 2, 0, True)),
]
CONTROL = ("control: wsa t256 g2 st5 split / no split", "gluon_int4_wsa_gemm",
           lambda m: wsa(m, 256, 2, True, 1, 0, 5), lambda m: wsa(m, 256, 2, False, 1, 0, 5))


def main(old: str, only: list[str]) -> int:
    bad = 0
    for name, module, fn, *control in [*CASES, CONTROL]:
        if only and not any(o in name for o in only):
            continue
        t0 = time.perf_counter()
        new_mod = importlib.import_module(f"tokenmill.layers.quantization.{module}")
        old_mod = importlib.import_module(f"{old}.{module}")
        (fa, sa), (fb, sb) = fn(new_mod), (control[0] if control else fn)(old_mod)
        same = _norm(sa) == _norm(sb) and fa == fb
        bad += same == bool(control)
        print(f"{name}: {'IDENTICAL' if same else 'DIFFERENT'} SASS ({len(sa.splitlines())} lines, {fa}) "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        if not same and not control:
            print("\n".join(list(difflib.unified_diff(_norm(sb).splitlines(), _norm(sa).splitlines(), lineterm=""))[:40]))
    return bad


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "int4old", sys.argv[2:]))
