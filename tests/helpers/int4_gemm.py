"""The Gluon INT4 GEMM tests' shared set-up (tests/layers/test_int4_wsa_gemm.py, test_int4_swap_gemm.py):
a random weight's codes, mma words, packed scales / offsets and x; the float64 weight those codes stand
for; an offline sm_90 compile of a Gluon kernel (no GPU) and its SASS.
"""

from __future__ import annotations

import os
import sys

import torch

from tokenmill.layers.quantization import int4_packing as packing


def case(n: int, k: int, group: int, m: int = 24, seed: int = 0):
    """(codes, mma words, packed scales / offsets, x bf16 [m, k]) of a random asymmetric [n, k] weight."""
    from tokenmill.layers.quantization.triton_int4_dot_gemm import packed_scale_offset

    g = torch.Generator().manual_seed(seed)
    codes = packing.quantize_int4(torch.randn(n, k, generator=g), group, sym=False)
    wt = packing.from_codes(codes, torch.bfloat16, act_order=False)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    return codes, packing.to_mma(wt.qweight), packed_scale_offset(wt.scales, wt.zeros), x


def reference_w(codes) -> torch.Tensor:
    """w^T [K, N] in float64 from the codes (scales / zeros rounded to bf16 as stored)."""
    s = codes.scales.to(torch.bfloat16).double()
    z = codes.zeros.to(torch.bfloat16).double()
    return ((codes.codes.double() - z[:, codes.g_idx]) * s[:, codes.g_idx]).t()


def compile_gluon_sm90(fn, const: dict, ptrs: dict, descs: dict | None = None, aligned=(), num_warps: int = 4
                       ) -> tuple[dict, str]:
    """(resource figures, SASS) of the Gluon kernel `fn` compiled for sm_90 without a GPU: `const` its
    constexprs, `ptrs` its pointers' element types (16-byte aligned), `descs` its TMA descriptors' types,
    every other argument i32 (`aligned` ones divisible by 16)."""
    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import sass_tools
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    descs = descs or {}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in descs:
            sig[name] = descs[name]
        elif name in ptrs:
            sig[name], attrs[(i,)] = "*" + ptrs[name], [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name in aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps})
    return sass_tools.disassemble(kernel)
