"""The W8A8 GEMM choices of the decode batch (256 rows) per Llama-8B linear, on this card, in one process.

    timeout 60 python scripts/gpu_fp8_w8a8_rows.py [--rows 256,8192]

Each (linear, GEMM) through the engine's own call (`fp8._w8a8_mm`, the W8A8_MEASURED entry set to the
GEMM named) in a CUDA graph of LAYERS calls over distinct weights (past L2, as a decode step's layers),
replayed; microseconds per call, best of 5 rounds, the GEMMs of a linear interleaved round by round.
Each output is checked against row-wise `_scaled_mm` first. Prints the table's current choice beside
the fastest; writes $OUT/gpu_fp8_w8a8_rows.json. (stream_tiles.W8A8_MEASURED came from an H200 for o /
down at 256 rows; the final card is an H100.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"o": (4096, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "gate_up": (28672, 4096)}
_P = "tma-m128n256k128g8w8st4s1-pers"  # the 8192-row entries' tiles (and gate_up's at 256)
# Per rows: (the GEMMs to time per linear). Round 2 (one H100): at 256 rows o 12.2 us on the swapped TMA
# tiles against 13.4 (the table's H200 tiles), down 37.1 on row-wise _scaled_mm against 39.4; qkv stays.
# Round 3 adds the TMA-stored output tiles (`TmaTiles.tstore`).
CHOICES = {
    256: {"o": ["tma-m128n64k128g8w4st5s1-swap", "tma-m128n64k128g8w4st5s1-swap-t1", "tma-m128n64k128g8w4st5s1-swap-t2"],
          "down": ["scaled_mm"],
          "qkv": ["scaled_mm", "tma-m128n64k128g8w4st5s1-swap-t1"],
          "gate_up": [_P + "-t2", "tma-m128n256k128g8w8st3s1-pers-t1", "tma-m128n256k128g8w8st3s1-pers-t2"]},
    8192: {"o": [_P + "-t2", "tma-m128n256k128g8w8st3s1-pers-t2"],
           "down": [_P + "-t2", "tma-m128n256k128g8w8st3s1-pers-t2"],
           "qkv": [_P + "-t2", "tma-m128n256k128g8w8st3s1-pers-t2"],
           "gate_up": [_P + "-t2", "tma-m128n256k128g8w8st3s1-pers-t1", "tma-m128n256k128g8w8st3s1-pers-t2"]},
}
LAYERS = 8
MIN_GAIN = 0.03  # a GEMM this much faster than the table's choice goes into $OUT/w8a8_override.json


def main() -> None:
    from tokenmill.layers.quantization import fp8_ops, stream_tiles
    from tokenmill.layers.quantization.fp8 import _w8a8_mm
    from tokenmill.layers.quantization.triton_fp8 import quantize_row_groups

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256,8192")
    ns = ap.parse_args()
    dev = torch.device("cuda")
    out_dir = os.environ.get("OUT", "./gpu-out")
    os.makedirs(out_dir, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name(dev)}
    override: dict = {}  # TOKENMILL_W8A8_TABLE's value (stream_tiles.W8A8_TABLE_ENV) for an engine A/B
    torch.manual_seed(0)
    for m in (int(r) for r in ns.rows.split(",")):
        bucket = stream_tiles.w8a8_bucket(m)
        for name, (n, k) in SHAPES.items():
            key = (bucket, n, k)
            current = stream_tiles.W8A8_MEASURED.get(key, "scaled_mm")
            layers = []
            for _ in range(LAYERS):
                wq, ws = fp8_ops.quantize_rows(torch.randn(n, k, device=dev) * 0.02)
                layers.append(SimpleNamespace(weight=wq, weight_scale=ws, scale_row=ws.reshape(1, -1).contiguous(),
                                              scale_one=torch.ones((), device=dev),
                                              stream_counters=stream_tiles.SplitCounters(n, dev)))
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, xs = quantize_row_groups(x, k)
            ref = torch._scaled_mm(xq, layers[0].weight.t(), scale_a=xs, scale_b=layers[0].scale_row,
                                   out_dtype=torch.bfloat16).float()
            graphs, errs = {}, {}
            for choice in [current] + [c for c in CHOICES[m][name] if c != current]:
                label = choice if isinstance(choice, str) else "triton " + "x".join(map(str, choice))
                stream_tiles.W8A8_MEASURED[key] = choice
                try:
                    out = _w8a8_mm(layers[0], xq, xs, torch.bfloat16).float()
                    errs[label] = ((out - ref).norm() / ref.norm()).item()
                    for _ in range(2):
                        for lay in layers:
                            _w8a8_mm(lay, xq, xs, torch.bfloat16)
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for lay in layers:
                            _w8a8_mm(lay, xq, xs, torch.bfloat16)
                    graphs[label] = g
                except Exception as e:  # noqa: BLE001 - a launch that fails is reported
                    print(f"  {name} m={m} {label}: {type(e).__name__}: {str(e)[:150]}", flush=True)
            stream_tiles.W8A8_MEASURED[key] = current
            times = {lab: [] for lab in graphs}
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            reps = 4 if m <= 1024 else 1
            for _ in range(5):
                for lab, g in graphs.items():
                    g.replay()
                    ev[0].record()
                    for _ in range(reps):
                        g.replay()
                    ev[1].record()
                    torch.cuda.synchronize()
                    times[lab].append(ev[0].elapsed_time(ev[1]) * 1e3 / (reps * LAYERS))
            best = {lab: min(v) for lab, v in times.items()}
            cur_label = current if isinstance(current, str) else "triton " + "x".join(map(str, current))
            results[f"{name}_m{m}"] = {"current": cur_label, "us": best, "rel_err": errs}
            order = sorted(best, key=best.get)
            if cur_label in best and best[order[0]] < (1 - MIN_GAIN) * best[cur_label] and errs[order[0]] < 1e-2:
                win = order[0]
                override[f"{bucket},{n},{k}"] = [int(v) for v in win.split()[1].split("x")] if win.startswith(
                    "triton ") else win
                with open(os.path.join(out_dir, "w8a8_override.json"), "w") as f:  # (as it grows: a cut run keeps it)
                    f.write(json.dumps(override, separators=(",", ":")))
            print(f"  {name} {n}x{k} m={m}: current {cur_label} {best.get(cur_label, float('nan')):.1f} us; "
                  + ", ".join(f"{lab} {best[lab]:.1f} (err {errs[lab]:.1e})" for lab in order), flush=True)
            del graphs, layers
            torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "gpu_fp8_w8a8_rows.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, "w8a8_override.json"), "w") as f:
        f.write(json.dumps(override, separators=(",", ":")) if override else "")
    print(f"  override: {override or 'none'}", flush=True)


if __name__ == "__main__":
    main()
