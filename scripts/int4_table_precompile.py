"""Compile every launch the INT4 GEMM table lists (`triton_int4_dot_gemm.TABLE`) in parallel
processes, so that an INT4 engine started next finds them in Triton's cache (its start-up self-test
otherwise compiles them one by one: ~5-8 s each). `python scripts/int4_table_precompile.py [timeout_s]`."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton_precompile  # scripts/


def _calls():
    import torch

    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot

    n, k, group = 1024, 4096, 128
    wt = packing.from_codes(packing.quantize_int4(torch.randn(n, k, device="cuda"), group, sym=False),
                            torch.bfloat16, act_order=False)
    qm = packing.to_mma(wt.qweight)
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    calls = []
    for t in dict.fromkeys(dot.TABLE.values()):
        x = torch.randn(t.block_m, k, device="cuda", dtype=torch.bfloat16)
        calls.append((t.label(), lambda t=t, x=x: dot.run(x, qm, wt.scales, wt.zeros, group, t, counters)))
    return calls


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--shard":
        triton_precompile.compile_shard(_calls(), sys.argv[2])
    else:
        from tokenmill.layers.quantization import triton_int4_dot_gemm as dot

        launches = len(set(dot.TABLE.values()))
        timeout = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
        triton_precompile.compile_in_processes(__file__, "--shard", max(1, min(launches, (os.cpu_count() or 2) - 1)),
                                               timeout, f"int4 table ({launches} launches)")
