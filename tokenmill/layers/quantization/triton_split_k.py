"""The split-K epilogue shared by the quantized GEMM kernels (see `stream_tiles` for the scheme).

`store_tile` writes a program's float32 tile: straight to the output without split-K (SPLIT_K
false: one slice);
else to its slice of the partials [split, M, N], then it counts itself in at the tile's counter
(acq_rel, after a CTA barrier so every thread's partial is written first). The program that
counts last sums the slices in slice order (deterministic), writes the output, and resets the
counter to zero for the next call. Partials are read through L2 (`.cg`): other SMs wrote them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_tile(acc, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, s_om, tile_id, pid_k, split,
               SPLIT_K: tl.constexpr):
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out_off = offs_m[:, None].to(tl.int64) * s_om + offs_n[None, :]
    if not SPLIT_K:  # compiled out when unused: the reduction's registers would cost large tiles
        tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        p_off = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        mn = N.to(tl.int64) * M
        tl.store(part_ptr + pid_k * mn + p_off, acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
        if arrived == split - 1:
            total = tl.zeros_like(acc)
            for s in range(0, split):
                total += tl.load(part_ptr + s * mn + p_off, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + out_off, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile_id, 0)
