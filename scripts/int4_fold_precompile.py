"""Compile the INT4 GEMV launches of the folded norms and residual adds (`int4_norm_fold`) for the
Llama-8B shapes at 1 and 2 rows, and the fold's self-test, in parallel processes, so that an INT4
engine started next finds them in Triton's cache (one by one in the engine: ~4 s each, ~15 launches).
`python scripts/int4_fold_precompile.py [timeout_s]`."""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton_precompile  # scripts/

HIDDEN, GROUP = 4096, 128
SHAPES = {"qkv": (6144, HIDDEN), "gate_up": (28672, HIDDEN), "o": (HIDDEN, HIDDEN), "down": (HIDDEN, 14336)}


@functools.cache
def _weights(name: str):
    """A shape's random INT4 weight in the mma layout (made by the shard that needs it: made for every
    shape in every process, 15 processes filled an H100's memory)."""
    import torch

    from tokenmill.layers.quantization import int4_packing as packing

    n, k = SHAPES[name]
    wt = packing.from_codes(packing.quantize_int4(torch.randn(n, k, device="cuda"), GROUP, sym=False),
                            torch.bfloat16, act_order=False)
    qm = packing.to_mma(wt.qweight)
    torch.cuda.empty_cache()
    return qm, wt.scales, wt.zeros


def _calls():
    import torch

    from tokenmill.layers.quantization import int4_norm_fold as fold
    from tokenmill.layers.quantization import triton_int4_mma as mma

    dev, dt = torch.device("cuda"), torch.bfloat16
    counters = torch.zeros(8192, dtype=torch.int32, device=dev)
    w = torch.ones(HIDDEN, dtype=dt, device=dev)
    calls = [("selftest", lambda: fold.selftest(dev, dt))]
    parts = mma.sumsq_parts(HIDDEN, HIDDEN, GROUP)  # o's (32); down's is 64: the same specialization
    for name, (n, k) in SHAPES.items():
        for m in (1, 2):
            for variant in ("scale", "prologue"):  # scale mode's launches, then prologue mode's
                if name in ("qkv", "gate_up"):
                    def call(m=m, variant=variant, name=name, k=k, silu=name == "gate_up"):
                        qm, scales, zeros = _weights(name)
                        stream = torch.randn(m, k, device=dev)
                        sumsq = stream.square().view(m, parts, -1).sum(2)
                        if variant == "scale":
                            return mma.mma_gemv(stream.to(dt), qm, scales, zeros, GROUP, counters=counters,
                                                silu=silu, rstd_of=(sumsq, 1e-5))
                        return mma.mma_gemv(stream, qm, scales, zeros, GROUP, counters=counters, silu=silu,
                                            norm=(w, 1e-5), sumsq=sumsq)
                else:  # the adds: with y (scale), without (prologue; scale's last layer)
                    def call(m=m, variant=variant, name=name, n=n, k=k):
                        qm, scales, zeros = _weights(name)
                        x = torch.randn(m, k, device=dev, dtype=dt)
                        stream = torch.randn(m, n, device=dev)
                        sumsq = torch.empty((m, mma.sumsq_parts(n, k, GROUP)), device=dev)
                        y = torch.empty((m, n), device=dev, dtype=dt) if variant == "scale" else None
                        return mma.mma_gemv(x, qm, scales, zeros, GROUP, counters=counters, add_to=stream,
                                            sumsq=sumsq, weighted=(y, w) if y is not None else None)
                calls.append((f"{name} m{m} {variant}", call))
    return calls


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--shard":
        triton_precompile.compile_shard(_calls(), sys.argv[2])
    else:
        timeout = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
        triton_precompile.compile_in_processes(__file__, "--shard", max(1, min(8, (os.cpu_count() or 2) - 1)),
                                               timeout, "int4 folded norm / add launches (17 calls)")
