"""From a `gpu_attention.py --short-variants` record ($OUT/gpu_attention.json): the fp8 decode launch
fastest at 256 rows x 320 keys among those no slower than the default (by more than 1%) at 256 x 640
and checked at both; prints it as a TOKENMILL_ATTN_CONFIG value (triton_backend.CONFIG_ENV), or
nothing when none beats the default by MIN_GAIN. A/B runs only.

    python scripts/gpu_fp8_attn_pick.py [$OUT/gpu_attention.json]
"""

from __future__ import annotations

import json
import os
import sys

MIN_GAIN = 0.03
FIELDS = {"block_n": "block_n", "decode_warps": "warps", "num_stages": "stages", "decode_min_rows": "min_rows",
          "early_v_load": "early_v_load", "table_prefetch": "table_prefetch", "fp8_convert_on_load": "fp8_convert_on_load"}
OTHER = ("interior", "lookup_blocks", "fp8_qk_dot", "fp8_pv_dot", "kv_splits", "fp8_v_transposed")


def pick(record: dict) -> tuple[dict | None, str]:
    recs = {r["case"]: r for r in record["records"] if r.get("kv") == "float8_e4m3fn" and "sweep" in r}
    short, long = recs.get("256x320"), recs.get("256x640")
    if not short or not long:
        return None, "no 256x320 / 256x640 fp8 records"
    key = lambda e: json.dumps({k: e[k] for k in FIELDS if k in e} | {k: e.get(k) for k in OTHER}, sort_keys=True)
    failed = {key(f["launch"]) for r in (short, long) for f in r.get("variant_failures", []) + r.get("sweep_failures", [])}
    at_long = {key(e): e["us"] for e in long["sweep"]}
    default = {k: short["plan"][k] for k in FIELDS}
    best, best_us = None, short["us"] * (1 - MIN_GAIN)
    for e in short["sweep"]:
        k = key(e)
        if k in failed or k not in at_long or at_long[k] > long["us"] * 1.01 or e["us"] >= best_us:
            continue
        if any(e.get(o) != short["plan"].get(o) for o in OTHER if o in short["plan"]):
            continue
        best, best_us = e, e["us"]
    if best is None:
        return None, f"none beats the default ({short['us']:.1f} us at 256x320) by {MIN_GAIN:.0%}"
    tiles = {FIELDS[k]: best[k] for k in FIELDS if k in best and best[k] != default.get(k)}
    return {"fp8_decode_tiles": tiles}, (f"256x320 {short['us']:.1f} -> {best_us:.1f} us, 256x640 {long['us']:.1f} -> "
                                         f"{at_long[key(best)]:.1f} us")


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ.get("OUT", "./gpu-out"), "gpu_attention.json")
    with open(path) as f:
        choice, why = pick(json.load(f))
    print(why, file=sys.stderr)
    if choice:
        print(json.dumps(choice, separators=(",", ":")))
