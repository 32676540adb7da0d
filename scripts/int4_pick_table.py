"""From an `int4gemm` sweep record (scripts/gpu_int4_gemm.py, `$OUT/int4gemm.json`), the
TOKENMILL_INT4_GEMM_TABLE value that routes each timed linear to its fastest swapped-GEMM launch
where that beats the engine's current path ("engine before") by at least MARGIN, so that an engine
started next in the same round runs the sweep's winners (`triton_int4_dot_gemm.table_override`).
`python scripts/int4_pick_table.py RECORD [ROWS]`: prints the value (empty: nothing wins), and the
choices on stderr."""

from __future__ import annotations

import json
import sys

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096)}
MARGIN = 0.97  # a launch replaces the current path only where it is >= 3% faster


def pick(rec: dict, rows: int = 256) -> str:
    items = []
    for name, (n, k) in SHAPES.items():
        r = rec.get("int4gemm", {}).get(f"m{rows}/{name}", {})
        swaps = {lab: us for lab, us in r.items() if lab.startswith("swap ")}
        before = r.get("engine before")
        if not swaps or before is None:
            continue
        label, us = min(swaps.items(), key=lambda kv: kv[1])
        win = us < MARGIN * before
        print(f"  {name}: best {label} {us:.1f} us, engine before {before:.1f}, bf16 {r.get('bf16', float('nan')):.1f}"
              f" -> {'route it' if win else 'keep'}", file=sys.stderr)
        if win:
            items.append(f"{rows},{n},{k}={label}")
    return ";".join(items)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(pick(json.load(f), int(sys.argv[2]) if len(sys.argv) > 2 else 256))
