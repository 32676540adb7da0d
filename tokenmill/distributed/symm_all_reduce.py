"""The TP all-reduce for small messages: one kernel over peer-to-peer buffers.

A decode step all-reduces a few MiB twice per layer; NCCL's ring/tree setup costs tens of
microseconds per call there. PyTorch's symmetric memory maps one buffer of every rank of the TP
group into each rank's address space (CUDA IPC), and its one-shot kernel copies the local input
into the local buffer, meets the peers at a barrier in device memory, and sums every rank's buffer
into the output: one launch, no host sync, capturable in a CUDA graph. Two-shot (reduce-scatter
then all-gather through the same buffers) moves the same bytes on two ranks but meets twice; it
is kept for larger groups. NCCL keeps the messages larger than the buffer (prefill chunks), other
dtypes, and every machine where the mapping cannot be made.

Which method serves which size is `choose_method` (pure arithmetic, tested on any machine); the
limits come from `tokenmill bench all-reduce` on the GPUs (docs/results/gpu-parallel.md).
`TOKENMILL_ALL_REDUCE=nccl` turns the symmetric path off.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_DTYPES = (torch.bfloat16, torch.float32)  # the symmetric-memory kernels' (no float16)
_ALIGN = 16  # bytes: the kernels' vector width


@dataclass(frozen=True)
class AllReduceLimits:
    """Messages of at most `max_bytes` take the symmetric buffer: one-shot up to `one_shot_bytes`,
    two-shot above. From `bench all-reduce` on two H100s (NVLink), bf16, inside CUDA graphs:
    one-shot 8.7-16.7 us up to 1 MiB (NCCL 15.5-25.4), two-shot 21-75 us from 2 to 16 MiB
    (NCCL 39-91), even at 32 MiB (149 vs 154), NCCL ahead at 64 MiB (263 vs 292)."""

    max_bytes: int = 32 << 20
    one_shot_bytes: int = 1 << 20


def choose_method(nbytes: int, dtype: torch.dtype, limits: AllReduceLimits | None) -> str:
    """"one_shot", "two_shot" or "nccl" for a message of `nbytes` (limits None: no symmetric buffer)."""
    if limits is None or dtype not in _DTYPES or nbytes == 0 or nbytes % _ALIGN or nbytes > limits.max_bytes:
        return "nccl"
    return "one_shot" if nbytes <= limits.one_shot_bytes else "two_shot"


def wanted() -> bool:
    return os.environ.get("TOKENMILL_ALL_REDUCE", "auto").lower() != "nccl"


class SymmetricAllReduce:
    """One rank's share of a TP group's symmetric buffer and the all-reduce over it."""

    def __init__(self, group, device: torch.device, limits: AllReduceLimits) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.limits = limits
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(limits.max_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)
        self._ops = torch.ops.symm_mem

    @staticmethod
    def create(group, device: torch.device, limits: AllReduceLimits | None = None) -> SymmetricAllReduce | None:
        """The buffer and a first all-reduce checked against the expected sum, or None (logged)
        where symmetric memory is unavailable (no CUDA IPC, no peer access, an older torch):
        NCCL then carries every message."""
        if device.type != "cuda" or not wanted():
            return None
        try:
            self = SymmetricAllReduce(group, device, limits or AllReduceLimits())
            self._self_test(group)
        except Exception as e:  # noqa: BLE001 - any failure means: keep NCCL
            logger.warning("symmetric-memory all-reduce unavailable (%s: %s); NCCL carries every message",
                           type(e).__name__, e)
            return None
        logger.info("TP all-reduce: symmetric memory up to %d KiB (one-shot up to %d KiB), NCCL above",
                    self.limits.max_bytes >> 10, self.limits.one_shot_bytes >> 10)
        return self

    def _self_test(self, group) -> None:
        import torch.distributed as dist

        rank, size = dist.get_rank(group), dist.get_world_size(group)
        for method in ("one_shot", "two_shot"):
            x = torch.full((1024,), float(rank + 1), dtype=torch.bfloat16, device=self.buffer.device)
            out = self.all_reduce(x, method)
            expected = size * (size + 1) / 2
            if not bool((out == expected).all()):
                raise RuntimeError(f"{method} all-reduce gave {out[:4].tolist()}, expected {expected}")

    def method_for(self, x: torch.Tensor) -> str:
        return choose_method(x.numel() * x.element_size(), x.dtype, self.limits)

    def all_reduce(self, x: torch.Tensor, method: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum over the group of `x` (contiguous, `method` from `method_for`), in a new tensor
        (or in `out`, contiguous, x's shape and dtype)."""
        flat = x.reshape(-1)
        out = torch.empty_like(flat) if out is None else out.view(-1)
        symm = self.buffer[:flat.numel() * flat.element_size()].view(flat.dtype)
        if method == "one_shot":
            self._ops.one_shot_all_reduce_copy_out(symm, flat, "sum", self.group_name, out)
        else:
            symm.copy_(flat)
            self._ops.two_shot_all_reduce_out(symm, "sum", self.group_name, out)
        return out.view_as(x)

    def start(self, x: torch.Tensor, stream: torch.cuda.Stream) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Fork: the sum over the group of `x` (`method_for(x)` not "nccl") into a new tensor, by this
        buffer's kernel on `stream` after the work queued on the current stream so far; returns the
        tensor and the event that marks its end. The caller joins (`current_stream().wait_event`)
        before it reads the sum, and keeps `x` alive until then: a join waits for this all-reduce
        only, not for ones started after it. Stream waits only: capturable in a CUDA graph."""
        out = torch.empty_like(x)  # (allocated on the current stream, which reads it after the join)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            self.all_reduce(x, self.method_for(x), out)
            done = torch.cuda.Event()
            done.record(stream)
        return out, done
