"""GPU check of the INT4 producers' K order (`quantization.int4_kperm`), before an engine times it:
- RMSNorm (alone and with the residual add) and SiLU-and-mul (natural and paired) with KPERM write
  `permute_x` of their natural output, bit for bit (only the output's store moves), the residual
  unchanged;
- `mma_matmul` on a permuted x (x_kperm) at 256 rows is the natural call's output bit for bit, for
  Llama-8B's qkv, gate_up and down shapes (the same launch reads the same bytes), and at 16 rows
  (not the swapped GEMM: x put back first);
- the Triton attention with kperm (o_proj's input), with and without split-KV, is `permute_x` of
  its natural output, bit for bit.
INT4_KPERM_CHECK_FULL=1: also 16 rows and the attention (more compiles). Prints one line per check
and exits 1 on a failure. `python scripts/gpu_int4_kperm_check.py`."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

FAILED = []


def check(ok: bool, what: str) -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        FAILED.append(what)


def main() -> int:
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization import stream_tiles
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot
    from tokenmill.layers.quantization import triton_int4_mma as mma
    from tokenmill.layers.quantization.gluon_int4_swap_gemm import permute_x
    from tokenmill.layers.quantization.int4_kperm import swap_route
    from tokenmill.layers.triton_ops.rms_norm import fused_add_rms_norm, rms_norm
    from tokenmill.layers.triton_ops.silu_and_mul import silu_and_mul

    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(256, 4096, device=dev, generator=g).to(bf)
    w = (1 + 0.1 * torch.randn(4096, device=dev, generator=g)).to(bf)
    ref, out = rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5, kperm=True)
    check(torch.equal(out, permute_x(ref)), "rms_norm kperm == permute_x(natural)")
    res = torch.randn(256, 4096, device=dev, generator=g)
    r1, r2 = res.clone(), res.clone()
    n1, r1 = fused_add_rms_norm(x, r1, w, 1e-5)
    n2, r2 = fused_add_rms_norm(x, r2, w, 1e-5, kperm=True)
    check(torch.equal(r1, r2) and torch.equal(n2, permute_x(n1)),
          "fused_add_rms_norm kperm: residual identical, normed == permute_x(natural)")
    h = torch.randn(256, 2 * 14336, device=dev, generator=g).to(bf)
    for paired in (False, True):
        check(torch.equal(silu_and_mul(h, paired=paired, kperm=True), permute_x(silu_and_mul(h, paired=paired))),
              f"silu_and_mul kperm (paired {paired}) == permute_x(natural)")
    for name, (n, k) in {"qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}.items():
        wt = packing.from_codes(packing.quantize_int4(torch.randn(n, k, device=dev, generator=g) * 0.02, 128, sym=False),
                                bf, act_order=False)
        qm = packing.to_mma(wt.qweight)
        dot.keep_scale_offset(wt.scales, wt.zeros)
        counters = stream_tiles.SplitCounters(n, torch.device(dev)).tensor
        for m in (256,) if os.environ.get("INT4_KPERM_CHECK_FULL") != "1" else (256, 16):
            xm = torch.randn(m, k, device=dev, generator=g).to(bf)
            nat = mma.mma_matmul(xm, qm, wt.scales, wt.zeros, 128, counters)
            perm = mma.mma_matmul(permute_x(xm), qm, wt.scales, wt.zeros, 128, counters, x_kperm=True)
            route = swap_route(m, n, k, 128, bf)
            check(torch.equal(nat, perm) and not counters.any(),
                  f"{name} m={m}: mma_matmul(x_kperm) == natural ({'swapped GEMM' if route else 'put back'};"
                  f" launch {dot.dot_tiles(m, n, k, 128, bf)})")
    import math

    from tests.layers.test_attention import make_case
    from tokenmill.layers.attention.triton_backend import (
        TritonAttentionBackend,
        TritonAttentionConfig,
    )

    for splits in (1, 4) if os.environ.get("INT4_KPERM_CHECK_FULL") == "1" else ():  # the attention's stores
        case = make_case([300, 0, 40, 97, 1000], [1, 3, 1, 5, 1], 16, 32, 8, bf, dev, pad_tokens=3, head_dim=128)
        be = TritonAttentionBackend(32, 8, 128, 1.0 / math.sqrt(128), config=TritonAttentionConfig(kv_splits=splits))
        nat = be.forward(case.q, case.k, case.v, case.kv_cache.clone(), case.meta)
        out = be.forward(case.q, case.k, case.v, case.kv_cache.clone(), case.meta, kperm=True)
        t = nat.shape[0]
        check(torch.equal(out.reshape(t, -1), permute_x(nat.reshape(t, -1))),
              f"attention kperm (kv splits {splits}) == permute_x(natural)")
    torch.cuda.synchronize()
    print(f"int4 kperm check: {len(FAILED)} failures", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
