"""Compile the paged-attention decode kernel for sm_90 on a machine without a GPU and count what its
SASS does per launch: registers, stack (spills), shared memory, and the instructions that matter for
an fp8 cache (byte-wise shared loads LDS.U8, ldmatrix LDSM / LDSM.T, cp.async LDGSTS, fp8
conversions F2FP, HMMA / wgmma), in the whole kernel and in one KV tile's loop body (`tile_loop`).
Use the GPU's triton: a different version compiles differently (triton 3.9 kept the transposed-values
launch in 228 registers; 3.6, the GPU's, spills it), e.g. `pip install --target DIR triton==3.6.0` and
PYTHONPATH=DIR. Uses triton's bundled ptxas / cuobjdump; needs no device.

    python scripts/attention_sass.py                       # the decode launches of the defaults
    python scripts/attention_sass.py --launch '{"kv": "fp8", "warps": 2, "stages": 1, "convert_on_load": false}'

Llama-3.1-8B heads (32 / 8, head_dim 128), block size 16, one-token decode tiles (16 rows). This is how
the fp8 cache's V tile was found read back from shared memory one byte per load (256 LDS.U8 per thread
per 128-key tile) where the compiler converts it after the p @ v layout change.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)  # a real compile
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_tools import compile_sm90, disassemble, opcodes  # noqa: E402

OPS = ("QGMMA", "HGMMA", "LDS.U8", "LDSM.16.MT88", "LDSM.16.M88", "LDGSTS", "LDG.E.128", "F2FP.F16.E4M3", "F2FP.F16.E5M2", "HMMA",
       "STL", "LDL")
DEFAULTS = [  # the decode launches of TritonAttentionConfig's defaults (see triton_backend.py), then others
    {"kv": "bf16", "warps": 4, "stages": 2, "split": False},
    {"kv": "bf16", "warps": 4, "stages": 2, "split": True},
    {"kv": "fp8", "warps": 4, "stages": 2, "split": False, "convert_on_load": 2},  # values converted on load
    {"kv": "fp8", "warps": 4, "stages": 4, "split": True, "convert_on_load": 2},
    {"kv": "fp8", "warps": 4, "stages": 2, "split": False, "convert_on_load": True},  # the defaults before
    {"kv": "fp8", "warps": 4, "stages": 4, "split": True, "convert_on_load": False},
    {"kv": "fp8", "warps": 4, "stages": 2, "split": False, "v_transposed": True},  # values transposed (opt-in)
]


def compile_launch(launch: dict):
    from tokenmill.layers.attention import triton_paged_attention as tpa

    kv = {"bf16": "bf16", "fp8": "fp8e4nv", "fp8_e5m2": "fp8e5"}[launch.get("kv", "fp8")]
    fp8 = kv.startswith("fp8")
    const = dict(NUM_HEADS=32, GROUP=4, GROUP_PAD=4, BLOCK_Q=launch.get("block_q", 4), BLOCK_N=launch.get("block_n", 128), BLOCK_SIZE=16,
                 HEAD_DIM=128, HEAD_DIM_PAD=128, SPLIT=launch.get("split", False), DOT_PRECISION="tf32", SEARCH=256,
                 SOFTCAP=False, KV_FP8=fp8, SINKS=False, F16_DOT=fp8, INTERIOR=True, LOOKUP_BLOCKS=False, WINDOWED=False,
                 F8_QK=launch.get("f8_qk", False), F8_PV=launch.get("f8_pv", False), EARLY_V=launch.get("early_v_load", False),
                 CVT_ON_LOAD=fp8 and launch.get("convert_on_load", False), E5M2=kv == "fp8e5",
                 PREFETCH_TABLE=launch.get("table_prefetch", False), PTX=True,
                 V_TRANS=launch.get("v_transposed", False), USE_PDL=True, PREWAIT=launch.get("prewait", False))
    ptrs = {"q_ptr": "bf16", "k_cache_ptr": kv, "v_cache_ptr": kv, "out_ptr": "bf16", "part_m_ptr": "fp32",
            "part_l_ptr": "fp32", "part_acc_ptr": "fp32", "qsl_ptr": "i32", "seq_lens_ptr": "i32",
            "block_table_ptr": "i32", "sinks_ptr": "fp32"}
    const.update(ROPE=bool(launch.get("rope")), FP8_MAX=448.0 if fp8 and launch.get("rope") else 0.0)
    if launch.get("rope"):  # this step's rotary + KV write inside (ROPE, with PREWAIT)
        ptrs.update(pos_ptr="i64", cos_ptr="fp32", sin_ptr="fp32", slot_ptr="i64", kn_ptr="bf16", vn_ptr="bf16")
    else:
        const.update(pos_ptr=None, cos_ptr=None, sin_ptr=None, slot_ptr=None, kn_ptr=None, vn_ptr=None)
    aligned = {"s_qt", "s_qh", "s_ot", "s_oh", "s_cb", "s_cs", "s_ch"}  # multiples of 16, as the engine's
    return compile_sm90(tpa._paged_attention_kernel, const, ptrs, aligned, floats=("qk_scale", "v_scale", "softcap", "inv_k_scale", "inv_v_scale"),
                        num_warps=launch.get("warps", 4), num_stages=launch.get("stages", 2),
                        **({"maxnreg": launch["maxnreg"]} if launch.get("maxnreg") else {}))


def sass_figures(kernel) -> dict:
    fig, sass = disassemble(kernel)
    lines = opcodes(sass)
    ops = Counter(lines)
    fig["instructions"] = sum(ops.values())
    for op in OPS:
        fig[op] = sum(n for name, n in ops.items() if name.startswith(op))
    fig["tile_loop"] = tile_loop(sass)
    return fig


TILE_OPS = {"LDGSTS": "LDGSTS", "LDS": "LDS.", "STS": "STS.", "LDSM": "LDSM", "STSM": "STSM", "BAR": "BAR.SYNC",
            "F2FP": "F2FP.F16.E", "HMMA": "HMMA", "GMMA": "QGMMA", "HGMMA": "HGMMA"}


def tile_loop(sass: str) -> dict:
    """Per-thread instructions of one KV tile: the body of the first loop with MMAs (a backward branch's
    range; the unmasked walk, before the masked one at the causal edge), counted by kind: cp.async
    (LDGSTS), shared loads / stores (LDS / STS; not ldmatrix LDSM / STSM), barriers, fp8 conversions
    (F2FP), tensor-core MMAs."""
    ins = [(int(a, 16), op, rest) for a, op, rest in
           re.findall(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_.]+)([^;]*);", sass, flags=re.M)]
    best: list[str] = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            if any(o.startswith(("HMMA", "HGMMA", "QGMMA")) for o in body):
                best = body
                break
    fig = {"instructions": len(best)}
    for name, prefix in TILE_OPS.items():
        fig[name] = sum(1 for o in best if o.startswith(prefix) or o == prefix.rstrip("."))
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launch", action="append", help="JSON: kv (bf16|fp8|fp8_e5m2), warps, stages, split, block_n, "
                    "block_q, convert_on_load (true, or 2: values only), early_v_load, table_prefetch, v_transposed, "
                    "f8_qk, f8_pv, prewait, rope, maxnreg (default: the defaults' decode launches)")
    args = ap.parse_args()
    launches = [json.loads(x) for x in args.launch] if args.launch else DEFAULTS
    for launch in launches:
        fig = sass_figures(compile_launch(launch))
        print(json.dumps(launch), json.dumps(fig), flush=True)


if __name__ == "__main__":
    main()
