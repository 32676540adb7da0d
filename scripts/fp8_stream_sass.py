"""Compile the fp8 weight-streaming GEMV (`triton_fp8_stream`) for sm_90 on a machine without a GPU
and count what one launch's SASS does: registers, spills, the weight loads issued before the PDL
wait (`griddepcontrol.wait`, ACQBULK / the DEPBAR-free prologue), cp.async (LDGSTS) and plain
128-bit loads, fp8 conversions (F2FP), FMAs. Uses triton's bundled ptxas / cuobjdump.

    python scripts/fp8_stream_sass.py                        # the engine's one-row tiles of Llama-8B
    python scripts/fp8_stream_sass.py --tiles m1n16k256s1w2st4pe3 --silu

The prologue count says whether the loads meant to stream across the wait (Tiles.pre) really
are issued before it: the compiler may sink a load below the wait to where its value is used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)  # a real compile
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_tools import compile_sm90, disassemble, opcodes  # noqa: E402

OPS = ("LDG.E.128", "LDG.E.64", "LDG.E", "LDGSTS", "LDS", "F2FP", "FFMA", "HADD2", "STL", "LDL")


def compile_tiles(label: str, silu: bool, out_f32: bool = False, int8: bool = False):
    from tokenmill.layers.quantization import triton_fp8_stream as ts
    from tokenmill.layers.quantization.stream_tiles import Tiles

    t = Tiles.parse(label)
    const = dict(FLAT=t.block_m == 1 and t.flat, BLOCK_SCALES=False, GROUP_N=1, GROUP_K=1, BLOCK_M=t.block_m,
                 BLOCK_N=t.block_n, BLOCK_K=t.block_k, DOT_PRECISION="tf32", SPLIT_K=t.split > 1,
                 PIPE=t.stages if t.pipe else None, USE_PDL=True, SILU_X=silu,
                 PRE=t.pre if t.block_m == 1 and t.flat else 1)
    ptrs = {"x_ptr": "bf16", "w_ptr": "i8" if int8 else "fp8e4nv", "s_ptr": "fp32", "out_ptr": "fp32" if out_f32 else "bf16",
            "part_ptr": "fp32", "cnt_ptr": "i32"}
    aligned = {"N", "K", "s_xm", "s_wn", "s_om"}
    return compile_sm90(ts._fp8_stream_kernel, const, ptrs, aligned, num_warps=t.warps, num_stages=t.stages)


def sass_figures(kernel) -> dict:
    fig, sass = disassemble(kernel)
    lines = opcodes(sass)
    ops = Counter(lines)
    fig["instructions"] = len(lines)
    for op in OPS:
        fig[op] = sum(n for name, n in ops.items() if name == op or name.startswith(op + "."))
    # griddepcontrol.wait is ACQBULK on sm_90; the global loads before it stream across the wait
    wait_at = next((i for i, op in enumerate(lines) if op.startswith("ACQBULK")), None)
    fig["wait_found"] = wait_at is not None
    if wait_at is not None:
        fig["weight_loads_before_wait"] = sum(1 for op in lines[:wait_at] if op.startswith(("LDG", "LDGSTS")))
    return fig


def main() -> None:
    from tokenmill.layers.quantization import stream_tiles

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", action="append", help="a Tiles label (default: the engine's one-row Llama-8B tiles)")
    ap.add_argument("--silu", action="store_true", help="the SiLU-in-the-loads variant (down_proj)")
    ap.add_argument("--head", action="store_true", help="the int8 LM head's launch (int8 weights, float32 out)")
    args = ap.parse_args()
    labels = args.tiles or sorted({stream_tiles.fp8_tiles(1, n, k, None, 132).label()
                                   for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))})
    for label in labels:
        print(label, json.dumps(sass_figures(compile_tiles(label, args.silu, out_f32=args.head, int8=args.head))),
              flush=True)


if __name__ == "__main__":
    main()
