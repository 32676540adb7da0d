"""Triton kernel: y = x @ W^T for one row (decode at batch 1), W [N, K] bf16/fp16/fp32 streamed once.

At one row a linear layer is a read of W: cuBLAS picks GEMM tiles (8-row MMA tiles plus a
split-K reduce kernel) that stream the half-width weights of TP=2 (N or K halved) at 60-75% of
the bandwidth they reach at full width. Here each program owns BLOCK_N output channels and
walks K in BLOCK_K steps: a [BLOCK_N, BLOCK_K] tile of W (rows of K contiguous: 16-byte vector
loads) times the row of x, multiplied elementwise into a float32 accumulator of the tile's shape
and summed over K once at the end. No split-K: small BLOCK_N gives enough programs to fill the
SMs (4096 channels / 8 = 512), so there is no partial buffer, no second launch and the sum's
order is fixed (deterministic). Tiles per (N, K) come from `gemv_tiles` (a fixed table: a CUDA
graph capture never compiles what the warm-up did not).

Torch reference: `gemv_reference` (float64).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GemvTiles:
    block_n: int = 8
    block_k: int = 512
    warps: int = 4
    stages: int = 1  # > 1: the K loop's loads software-pipelined (cp.async)

    @property
    def label(self) -> str:
        return f"n{self.block_n}k{self.block_k}w{self.warps}s{self.stages}"


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, s_wn,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = w_ptr + tl.where(n_mask, offs_n, 0)[:, None].to(tl.int64) * s_wn  # past N: row 0, never stored
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(rows + offs_k[None, :], eviction_policy="evict_first")
            x = tl.load(x_ptr + offs_k)
        else:
            k_mask = offs_k < K
            w = tl.load(rows + offs_k[None, :], mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


# (N, K) -> tiles, from `scripts/gpu_gemv.py` on an H200 (Llama-3.1-8B's linears at TP=1 and TP=2;
# bf16, a graph of distinct weights past L2; docs/results/gpu-parallel.md): the shapes where the
# best tiles beat cuBLAS (`F.linear`, its split-K reduce included) by 3% or more, us per call.
# Only these shapes take the GEMV (`applies`); DEFAULT serves `TOKENMILL_GEMV=all` and tests.
DEFAULT = GemvTiles()
TABLE: dict[tuple[int, int], GemvTiles] = {
    (3072, 4096): GemvTiles(2, 1024, 4, 1),   # TP=2 qkv:      7.85 against cuBLAS 10.84
    (4096, 2048): GemvTiles(4, 1024, 4, 1),   # TP=2 o:        6.01 against 7.14
    (14336, 4096): GemvTiles(16, 256, 4, 1),  # TP=2 gate_up: 29.03 against 30.88
    (4096, 7168): GemvTiles(8, 512, 4, 3),    # TP=2 down:    15.81 against 19.79
    (64128, 4096): GemvTiles(2, 1024, 4, 1),  # TP=2 LM head: 119.8 against 149.9
    (6144, 4096): GemvTiles(2, 1024, 4, 1),   # one GPU qkv:  13.76 against 15.52
    (4096, 4096): GemvTiles(8, 512, 4, 3),    # one GPU o:    10.11 against 13.36
    (4096, 14336): GemvTiles(8, 512, 4, 3),   # one GPU down: 29.00 against 32.21
    (128256, 4096): GemvTiles(16, 256, 4, 1),  # one GPU LM head: 235.0 against 283.5
}  # (one GPU's gate_up, 28672 x 4096: 55.3 against 56.8, left to cuBLAS)


def gemv_tiles(n: int, k: int) -> GemvTiles:
    return TABLE.get((n, k), DEFAULT)


_DTYPES = (torch.bfloat16, torch.float16)


def wanted() -> bool:
    """`TOKENMILL_GEMV=0`: every one-row linear through cuBLAS (A/B); `all`: every shape through the
    GEMV (tile sweeps); default: the shapes of TABLE."""
    return os.environ.get("TOKENMILL_GEMV", "1").lower() not in ("0", "false", "no")


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a one-row linear on the device goes through `gemv` (shapes where it measured faster)."""
    if not (x.dtype in _DTYPES and weight.dtype == x.dtype and weight.dim() == 2 and weight.stride(1) == 1
            and weight.device == x.device and (bias is None or bias.dtype == x.dtype) and wanted()):
        return False
    return (weight.shape[0], weight.shape[1]) in TABLE or os.environ.get("TOKENMILL_GEMV", "").lower() == "all"


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         tiles: GemvTiles | None = None) -> torch.Tensor:
    """x [1, K] (or [K]) @ weight [N, K]^T (+ bias) -> [1, N] (or [N]) in x's dtype; weight rows contiguous."""
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.stride(1) != 1 or x.numel() != k:
        raise ValueError(f"gemv: one row of K={k} and a weight with contiguous rows, got x {tuple(x.shape)}, "
                         f"weight strides {weight.stride()}")
    t = tiles or gemv_tiles(n, k)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, t.block_n),)](
        x.contiguous(), weight, bias if bias is not None else out, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=t.block_n, BLOCK_K=t.block_k, EVEN_K=k % t.block_k == 0,
        STAGES=t.stages, num_warps=t.warps, num_stages=t.stages)
    return out


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ weight.double().t()
    return y + bias.double() if bias is not None else y
