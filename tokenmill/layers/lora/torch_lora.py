"""Batched LoRA in torch: the reference (per token) and the CPU path (per slot)."""

from __future__ import annotations

import torch


def lora_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, part_starts: tuple[int, ...],
                   token_slots: torch.Tensor) -> torch.Tensor:
    """The delta to add to y: token t gets (x[t] @ A[s]^T) @ B[s]^T with s = token_slots[t]
    (nothing where s < 0). `part_starts`: output column where each part starts, then `out`."""
    rank = b.shape[2]
    valid = token_slots >= 0
    s = token_slots.clamp_min(0).long()
    shrunk = torch.einsum("tk,trk->tr", x.float(), a[s].float())  # [T, parts * R]
    delta = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    for i, (lo, hi) in enumerate(zip(part_starts[:-1], part_starts[1:])):
        delta[:, lo:hi] = torch.einsum("tr,tnr->tn", shrunk[:, i * rank:(i + 1) * rank], b[s, lo:hi].float())
    return delta * valid[:, None]


def lora_add_grouped(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     part_starts: tuple[int, ...], groups: list[tuple[int, torch.Tensor | None]]) -> torch.Tensor:
    """The CPU path: y += delta, two small matmuls per (slot, its tokens) group (`None`: every token)."""
    rank = b.shape[2]
    for slot, rows in groups:
        xs = x if rows is None else x.index_select(0, rows)
        shrunk = xs @ a[slot].t()
        if len(part_starts) == 2:
            delta = shrunk @ b[slot].t()
        else:
            delta = torch.cat([shrunk[:, i * rank:(i + 1) * rank] @ b[slot, lo:hi].t()
                               for i, (lo, hi) in enumerate(zip(part_starts[:-1], part_starts[1:]))], dim=1)
        delta = delta.to(y.dtype)  # y may be wider (a float32 residual stream added in the matmul)
        if rows is None:
            y.add_(delta)
        else:
            y.index_add_(0, rows, delta)
    return y
