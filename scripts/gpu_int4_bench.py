"""The INT4 GEMM benches' shared parts (scripts/gpu_int4_wsa.py): a Llama-8B layer's linears, random
INT4 weights in the engine's mma layout, copies of them cycled past L2, us per call from CUDA-graph
replays, relative errors and JSON written atomically.
"""

from __future__ import annotations

import json
import math
import os

import torch

LLAMA = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096)}


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (out in any float dtype, ref float32)."""
    return ((out.float() - ref).norm() / ref.norm()).item()


def dump(obj, path: str) -> None:
    """JSON into path through a temporary file (a reader never sees half of it)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def weights(n: int, k: int, group: int, seed: int = 0):
    """(w bf16 [N, K], Int4Weights, mma words, packed scales / offsets, float32 dequantized w^T [K, N]) on
    the GPU, the packed scales kept on the scales tensor as the engine keeps them from load."""
    from tokenmill.layers.quantization import int4_packing as packing
    from tokenmill.layers.quantization.triton_int4_dot_gemm import packed_scale_offset
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    wt = packing.from_codes(packing.quantize_int4(w, group, sym=False), torch.bfloat16, act_order=False)
    qm = packing.to_mma(wt.qweight)
    sz = packed_scale_offset(wt.scales, wt.zeros)
    wt.scales._int4_dot_sz = sz
    return w, wt, qm, sz, packing.dequantize(wt, group, torch.float32)


def prepare(n: int, k: int, group: int):
    """A linear's (wt, words, packed scales, float32 reference, bf16 copies, INT4 copies (words, scales,
    zeros, packed)) with enough copies of each to cycle ~150 MB (past the 50 MB L2)."""
    w, wt, qm, sz, ref_w = weights(n, k, group)
    n_bf = max(2, math.ceil(150e6 / (w.numel() * 2)))
    n_q = max(2, math.ceil(150e6 / (qm.numel() * 4 + sz.numel() * 4)))
    bf = [w] + [w.clone() for _ in range(n_bf - 1)]
    q = [(qm, wt.scales, wt.zeros, sz)]
    for _ in range(n_q - 1):
        s = wt.scales.clone()
        s._int4_dot_sz = sz.clone()
        q.append((qm.clone(), s, wt.zeros.clone(), s._int4_dot_sz))
    return wt, qm, sz, ref_w, bf, q


def graph_us(fn, copies: int, reps: int = 20) -> float:
    """us per call: a CUDA graph of `reps` calls fn(i) (i: the weight copy), replayed, median of 5."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(2):
            fn(i % copies)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(reps):
            fn(r % copies)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    del graph
    return sorted(times)[2]
