"""What `gluon_int4_swap_gemm.permute_x` (x's columns into the mma layout's K order, one copy per
linear) costs on a GPU at the row counts the swapped GEMM serves: us per call for Llama-8B's two
input widths, from a CUDA graph of 50 calls, for the Triton kernel (`triton_x_permute`, what
`permute_x` runs on CUDA) and torch's view permute copy (its reference). Writes $OUT/permute_cost.json."""

from __future__ import annotations

import json
import os

import torch

from tokenmill.layers.quantization.gluon_int4_swap_gemm import permute_x


def _us(fn, x) -> float:
    for _ in range(3):
        fn(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(50):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50 * 1000


def main() -> None:
    res = {}
    views = {"triton": permute_x,
             "torch": lambda x: x.reshape(x.shape[0], -1, 4, 4, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(x.shape)}
    for m in (64, 128, 256, 8192):
        for k in (4096, 14336):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(views["triton"](x), views["torch"](x))
            for name, fn in views.items():
                res[f"{name} m{m}/k{k}"] = _us(fn, x)
            print(f"  permute_x m{m} k{k}: triton {res[f'triton m{m}/k{k}']:.1f} us, torch "
                  f"{res[f'torch m{m}/k{k}']:.1f} us", flush=True)
    os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "."), "permute_cost.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
