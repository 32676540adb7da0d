"""Compile the tensor-core INT4 GEMV (`triton_int4_mma`) for sm_90 on a machine without a GPU and
count what its SASS does: registers, spills, HMMA / LDG / LOP3 / SHF / HADD2 per launch, and
whether every global load of a loop step is issued before its first HMMA (what the `early`
predicate is for). Uses triton's bundled ptxas / cuobjdump; needs no device.

    python scripts/int4_mma_sass.py                     # the defaults
    python scripts/int4_mma_sass.py --launch '{"warps": 8, "split": 4, "gpc": 2, "zmma": true, "f16": false}'
    python scripts/int4_mma_sass.py --launch '{"warps": 4, "split": 8, "pdl": true}'   # PDL, first step preloaded
    python scripts/int4_mma_sass.py --launch '{"warps": 4, "split": 2, "pdl": true, "silu": true, "maxnreg": 48}'

With "pdl" (and "pre", default true) it also counts the 16-byte loads before the PDL wait
(`ACQBULK`, griddepcontrol.wait) and the loads there of data other kernels write (none allowed).
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

DEFAULTS = [{"warps": 4, "split": 1}, {"warps": 4, "split": 4, "gpc": 2, "zmma": True, "hint": True, "f16": True},
            {"warps": 8, "split": 2, "zmma": True}, {"warps": 4, "split": 1, "early": False}]
OPS = ("HMMA", "LDG", "LOP3", "SHF", "HADD2", "HFMA2", "IMAD", "STL", "LDL", "CCTL")


def compile_launch(launch: dict):
    from tokenmill.layers.quantization import triton_int4_mma as mma

    group = launch.get("group", 128)
    f16 = launch.get("f16", False)
    texts = (group // 64, launch.get("gpc", 1), f16, launch.get("early", True), launch.get("zmma", False),
             launch.get("hint", False))
    ahead = launch.get("ahead", 0)
    ring = launch.get("ring", 0)
    setup, step, store, store32 = mma._asm_texts(*texts, ("L1" if launch.get("ahead_l1") else "L2") if ahead else "",
                                                 ring, launch.get("warps", 4))
    if ring or launch.get("pipe") or launch.get("norm"):
        use_pdl_pre = False
    else:
        use_pdl_pre = True
    use_pdl = launch.get("pdl", False)
    pre, step_in = mma._pre_texts(*texts) if use_pdl and use_pdl_pre and launch.get("pre", True) else ("", "")
    const = dict(GROUP=group, SPLIT=launch.get("split", 1), WARPS=launch.get("warps", 4), GPC=launch.get("gpc", 1),
                 ASM=True, ASM_SETUP=setup, ASM_STEP=step, ASM_STORE=store, ASM_STORE_F32=store32,
                 USE_PDL=use_pdl, ASM_PRE=pre, ASM_STEP_IN=step_in, AHEAD=ahead, RING=ring,
                 ASM_PF=mma._prefetch_asm(texts[0] * texts[1], "L1" if launch.get("ahead_l1") else "L2")
                 if pre and ahead else "",
                 SILU=launch.get("silu", False), ASM_STORE_PAIR=mma._store_pair_asm(f16) if launch.get("silu") else "",
                 ASM_PIPE=mma._pipe_asm(f16, launch.get("hint", False), ahead > 0) if launch.get("pipe") else "",
                 ASM_FIRST=mma._pipe_first_asm(launch.get("hint", False)) if launch.get("pipe") else "",
                 NORM=launch.get("norm", False), KB=128 * launch.get("warps", 4) if launch.get("norm") else 1, RES=launch.get("res", False))
    dt = "fp16" if f16 else "bf16"
    ptrs = {"x_ptr": dt, "w_ptr": "i32", "s_ptr": dt, "z_ptr": dt, "out_ptr": dt, "part_ptr": "fp32", "cnt_ptr": "i32"}
    if launch.get("norm") or launch.get("res"):  # the folded norm / residual add (`int4_norm_fold`)
        ptrs.update(res_ptr="fp32", **({"nw_ptr": dt} if launch.get("norm") else {}))
    if launch.get("sq"):  # sums of squares handed from the add to the norm
        const["SQ"] = True
        ptrs["sq_ptr"] = "fp32"
    elif not launch.get("rstd"):
        const.update(SQ=False, sq_ptr=None)
    else:
        const["SQ"] = False
    const.update(YW=launch.get("yw", False), RSTD=launch.get("rstd", False))
    if launch.get("yw"):  # scale mode's add: y = stream * weight
        ptrs.update(y_ptr=dt, nw_ptr=dt)
    else:
        const["y_ptr"] = None
    if launch.get("rstd"):  # scale mode's GEMV: rows times rstd in the split-K epilogue
        ptrs["sq_ptr"] = "fp32"
        const["KB"] = 64
    if not launch.get("norm") and not launch.get("yw"):
        const["nw_ptr"] = None
    if not (launch.get("norm") or launch.get("res")):
        const["res_ptr"] = None
    extra = {"maxnreg": launch["maxnreg"]} if launch.get("maxnreg") else {}
    return compile_sm90(mma._mma_gemv_kernel, const, ptrs, floats=("inv_n", "eps"), num_warps=launch.get("warps", 4),
                        **extra)


def sass_figures(kernel) -> dict:
    fig, sass = disassemble(kernel)
    ops = opcodes(sass)
    counts = Counter(op.split(".")[0] for op in ops)
    for op in OPS:
        fig[op] = counts.get(op, 0)
    # loads of the loop step (128-bit: weights and x) before its first HMMA
    first_mma = next((i for i, op in enumerate(ops) if op.startswith("HMMA")), len(ops))
    wide = [i for i, op in enumerate(ops) if op.startswith("LDG") and ".128" in op]
    fig["wide_loads_before_first_hmma"] = sum(i < first_mma for i in wide)
    fig["wide_loads"] = len(wide)
    wait = next((i for i, op in enumerate(ops) if op.startswith("ACQBULK")), None)
    if wait is not None:  # PDL: the weight words loaded before griddepcontrol.wait, none of x's loads
        fig["wide_loads_before_wait"] = sum(i < wait for i in wide)
        # loads of data another kernel may write (x, partials, counters): not read-only (.CONSTANT);
        # ptxas may hoist a read-only scale load above the wait (constant data: harmless)
        fig["prefetches_before_wait"] = sum(i < wait for i, op in enumerate(ops) if op.startswith("CCTL.E.PF"))
        fig["plain_loads_before_wait"] = sum(i < wait for i, op in enumerate(ops)
                                             if op.startswith(("LDG", "LD.", "ATOM", "RED")) and "CONSTANT" not in op)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launch", action="append",
                    help="JSON: warps, split, gpc, zmma, hint, early, f16, group, pdl, pre, ahead, ring, silu, maxnreg, "
                         "norm, res, sq, yw, rstd")
    args = ap.parse_args()
    for launch in ([json.loads(x) for x in args.launch] if args.launch else DEFAULTS):
        print(json.dumps(launch), json.dumps(sass_figures(compile_launch(launch))), flush=True)


if __name__ == "__main__":
    main()
