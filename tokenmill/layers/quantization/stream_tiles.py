"""Tile configurations of the quantized GEMM kernels (`triton_fp8_stream`, `triton_int4_stream`),
chosen per (kind, rows bucket, N, K) from a fixed table: no autotuning, so a CUDA-graph capture
never compiles or times anything it has not seen in the warm-up (which runs every captured batch
size first). The table's figures come from `scripts/gpu_quant.py --parts tune` on an H100.

Split-K: small batches cannot fill 132 SMs with N tiles alone, so K is cut into `split`
slices; each program writes its float32 partial tile, and the last program of a tile (an
atomic counter per tile says which) sums the slices in a fixed order, writes the output and
resets its counter to zero (so graph replays find the counters zeroed). One launch, no memset,
deterministic sums. The counters belong to one layer (`SplitCounters`), so two layers running
on two streams at once never share one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tiles:
    """One launch configuration. `block_m == 1`: the GEMV path (one row per program, CUDA-core
    FMAs); otherwise tensor-core `tl.dot` tiles. `split`: programs along K per output tile."""

    block_m: int
    block_n: int
    block_k: int
    split: int = 1
    warps: int = 4
    stages: int = 3
    nibble_dots: bool = True  # int4 tensor-core tiles: 8 dots over strided x (else one, after a reshape)
    flat: bool = True  # fp8 one-row tiles (channel scales): sum over K once at the end (else each step)

    def label(self) -> str:
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split}w{self.warps}st{self.stages}"
                f"{'' if self.nibble_dots else 'r'}{'' if self.flat else 'f'}")


# Rows up to which the fp8 weight-streaming kernel runs (bf16 activations, no activation
# quantization); above it torch._scaled_mm (W8A8) is faster. Measured: scripts/gpu_quant.py tune.
FP8_STREAM_MAX_ROWS = 16
# INT4 (no act-order): rows up to which the GEMV / small-tile kernel runs; above it the
# tensor-core tiles, up to INT4_DEQUANT_MIN_ROWS, from where dequantize + cuBLAS runs.
INT4_STREAM_MAX_ROWS = 16
INT4_DEQUANT_MIN_ROWS = 1 << 30  # never, until a measurement says the dequantize path wins

# The SMs to fill (an H100 SXM has 132); read from the device where there is one.
_DEFAULT_SMS = 132


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device.index or 0).multi_processor_count


def _split_for(tiles_mn: int, k: int, block_k: int, sms: int, max_split: int = 8) -> int:
    """Enough K slices that the grid has about 2 programs per SM, each slice >= 4 K tiles."""
    if tiles_mn >= 2 * sms:
        return 1
    want = -(-2 * sms // tiles_mn)
    return max(1, min(want, k // (4 * block_k), max_split))


def fp8_tiles(m: int, n: int, k: int, block_scales: tuple[int, int] | None, sms: int) -> Tiles:
    """The fp8 weight-streaming kernel's configuration for an [m, k] x [n, k]^T product."""
    if m == 1:
        bm, bn, bk, warps = 1, 32, 256, 4
    else:
        bm, bn, bk, warps = 16, 64, 128, 4
    if block_scales is not None:  # a K tile inside one K block, an N tile inside one N block
        bn, bk = min(bn, block_scales[0]), min(bk, block_scales[1])
    tiles_mn = -(-m // max(bm, 1)) * -(-n // bn)
    return Tiles(bm, bn, bk, _split_for(tiles_mn, k, bk, sms), warps)


def streams_blocks(block: tuple[int, int]) -> bool:
    """Whether fp8 scale blocks of this shape fit the streaming kernel's power-of-two tiles."""
    return all(b >= 16 and b & (b - 1) == 0 for b in block)


def int4_tiles(m: int, n: int, k: int, group: int, sms: int) -> Tiles:
    """The INT4 kernel's configuration; `group` is the group size (k for one group)."""
    if m == 1:
        bm, bn, bk, warps, stages = 1, 64, 128, 4, 3
    elif m <= INT4_STREAM_MAX_ROWS:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 3
    elif m <= 64:
        bm, bn, bk, warps, stages = 64, 64, 128, 4, 3
    elif m <= 256:
        bm, bn, bk, warps, stages = 64, 128, 128, 4, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 128, 8, 3
    bk = _fit_k(bk, group)
    tiles_mn = -(-m // bm) * -(-n // bn)
    split = _split_for(tiles_mn, k, bk, sms) if m <= 64 else 1
    return Tiles(bm, bn, bk, split, warps, stages)


def _fit_k(block_k: int, group: int) -> int:
    """The largest power of two <= block_k dividing the group (a K tile never straddles two)."""
    while block_k > 16 and group % block_k:
        block_k //= 2
    return block_k


class SplitCounters:
    """A layer's zeroed int32 counters for split-K (one per output tile); allocated at load,
    outside any graph capture. Tiles beyond its size run without split."""

    def __init__(self, n: int, device: torch.device, rows_tiles: int = 4, min_block_n: int = 16) -> None:
        self.tensor = torch.zeros(rows_tiles * -(-n // min_block_n), dtype=torch.int32, device=device)

    def fits(self, tiles: int) -> bool:
        return tiles <= self.tensor.numel()
