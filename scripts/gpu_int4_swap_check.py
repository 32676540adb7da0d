"""GPU check of the swapped Gluon INT4 GEMM (`gluon_int4_swap_gemm`) with a diagnosis when it is
wrong: per launch, the relative error against a float32 reference (dequantize + matmul) on a small
weight; above 1e-2, where the error sits (per 16-channel block, per row, per 64-input step: x zero
but for one step) so that a wrong fragment map, K order or pipeline stage can be told apart.
Writes $OUT/swap_check.json. Run after the sweep (its launches are then compiled)."""

from __future__ import annotations

import json
import os

import torch

from tokenmill.layers.quantization import int4_packing as packing
from tokenmill.layers.quantization.gluon_int4_swap_gemm import swap_gemm
from tokenmill.layers.quantization.triton_int4_dot_gemm import SwapTiles as S


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b).norm() / b.norm().clamp(min=1e-30)).item()


def main() -> None:
    torch.manual_seed(0)
    n, k, group = 512, 1024, 128
    codes = packing.quantize_int4(torch.randn(n, k, device="cuda"), group, sym=False)
    wt = packing.from_codes(codes, torch.bfloat16, act_order=False)
    qm = packing.to_mma(wt.qweight)
    ref_w = packing.dequantize(wt, group, torch.float32)
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    res = {}
    for t in (S(256, 8, 4), S(256, 8, 4, xnat=True), S(64, 4, 4), S(128, 8, 4, 2), S(256, 4, 3, 2),
              S(128, 8, 4, ahead=1, cpw=2), S(64, 4, 4, 2, cpw=2), S(256, 8, 5, wtop=True),
              S(256, 8, 5, 4, xnat=True, wtop=True)):
        for m in (t.block_t, t.block_t - 37):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            try:
                err = _rel(swap_gemm(x, qm, wt.scales, wt.zeros, group, t, counters=counters), x.float() @ ref_w)
            except Exception as e:  # noqa: BLE001 - reported
                res[f"{t.label()} m{m}"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  {t.label()} m{m}: {res[f'{t.label()} m{m}']}", flush=True)
                break
            res[f"{t.label()} m{m}"] = err
            print(f"  {t.label()} m{m}: rel err {err:.2e}", flush=True)
            if err > 1e-2:
                out = swap_gemm(x, qm, wt.scales, wt.zeros, group, t, counters=counters).float()
                ref = x.float() @ ref_w
                d = (out - ref).abs()
                blocks = [round(d[:, 16 * b:16 * b + 16].mean().item() / ref.abs().mean().item(), 3) for b in range(8)]
                rows = [round(d[r].mean().item() / ref.abs().mean().item(), 3) for r in range(8)]
                steps = []
                for s in range(k // 64):
                    xs = torch.zeros_like(x)
                    xs[:, 64 * s:64 * s + 64] = x[:, 64 * s:64 * s + 64]
                    steps.append(round(_rel(swap_gemm(xs, qm, wt.scales, wt.zeros, group, t, counters=counters),
                                            xs.float() @ ref_w), 3))
                res[f"{t.label()} m{m} diag"] = {"blocks": blocks, "rows": rows, "steps": steps}
                print(f"    per 16-channel block {blocks}\n    per row {rows}\n    per step alone {steps}", flush=True)
    os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "."), "swap_check.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
