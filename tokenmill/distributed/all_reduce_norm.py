"""The TP all-reduce fused with the residual add and RMSNorm that follow it (decode-sized messages).

In a decoder layer each row-parallel linear (o_proj, down_proj) is followed by an all-reduce, the
residual add and an RMSNorm: two launches with the one-shot all-reduce, plus the round trip of
the reduced rows through memory. `FusedAllReduceNorm` does all of it in one kernel
(`all_reduce_norm_kernel`) over a symmetric buffer of its own: capturable in CUDA graphs, no
host syncs. The layers hand it the partial sums (`PendingAllReduce` in `parallel_state`); what it
does not take (messages over half its buffer, other shapes) goes the usual way.

Numerics: the ranks' partials are summed in float32 in rank order and added to the float32
residual unrounded (`reference`), one rounding fewer than all-reduce-then-add (the reduced sum
in bf16); every rank computes the same bits, so the replicated residual streams stay equal.
`TOKENMILL_FUSED_ALL_REDUCE_NORM=0` turns it off (A/B measurements). `TOKENMILL_ALL_REDUCE_NORM_VARIANT`
picks the kernel: `pull` (each rank reads its peers' buffers after a signal; `TOKENMILL_ALL_REDUCE_NORM_PUSH=0`
too), `push` (each rank stores its rows into every peer's buffer, reads are local; `..._PUSH=1` too) or
`lamport` (the default: pushed rows that carry their own readiness, no signals, `all_reduce_norm_lamport`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_HIDDEN = 16384  # a row is held in registers


@dataclass(frozen=True)
class FusedNormLimits:
    """Messages (rows x hidden x element size) of at most `max_bytes` take the fused kernel; each
    half of the buffer holds `half_bytes` (more than the engine uses, so `bench all-reduce` can
    time larger messages). On two H200s, bf16, hidden 4096, in CUDA graphs: 6.0 / 7.0 / 10.6 us at
    1 / 32 / 128 rows against 8.7 / 11.5 / 17.2 for one-shot + the Triton add + norm; 2 MiB
    (256 rows) extrapolates to ~17 us against ~27 for two-shot + norm."""

    half_bytes: int = 4 << 20
    max_bytes: int = 2 << 20


# The lamport variant's largest message by default (TOKENMILL_ALL_REDUCE_NORM_MAX_MIB): 1024 rows of
# 4096 in bf16, a decode step of 1000 rows at TP=2, where it took 50.1 us on two H200s against 66.3
# for NCCL + norm and ~58 for the two-shot + its copy + norm (engine profile); not 8192 rows (434 vs 380).
LAMPORT_MAX_MIB = 8


def default_limits(variant: str, world: int) -> FusedNormLimits:
    """Pull and push: `FusedNormLimits()`. Lamport: a message of up to TOKENMILL_ALL_REDUCE_NORM_MAX_MIB
    (default LAMPORT_MAX_MIB) from every peer in each of its three epochs (at 64 MiB, a prefill chunk
    of 8192 tokens x 4096 in bf16: 384 MiB per GPU at two ranks)."""
    if variant != "lamport":
        return FusedNormLimits()
    mib = float(os.environ.get("TOKENMILL_ALL_REDUCE_NORM_MAX_MIB", LAMPORT_MAX_MIB))
    max_bytes = int(mib * (1 << 20)) // 16 * 16
    return FusedNormLimits(half_bytes=max(max_bytes * world, 1 << 20), max_bytes=max_bytes)


def wanted() -> bool:
    return os.environ.get("TOKENMILL_FUSED_ALL_REDUCE_NORM", "1").lower() not in ("0", "false", "no")


VARIANTS = ("pull", "push", "lamport")


def variant_wanted() -> str:
    """The kernel variant the environment asks for (see the module's docstring)."""
    name = os.environ.get("TOKENMILL_ALL_REDUCE_NORM_VARIANT", "").lower()
    if name:
        if name not in VARIANTS:
            raise ValueError(f"TOKENMILL_ALL_REDUCE_NORM_VARIANT={name!r}: expected one of {', '.join(VARIANTS)}")
        return name
    # Default lamport: on two H200s 3.9 / 6.9 / 50.1 us at 1 / 128 / 1024 rows against push's 5.5 /
    # 10.2 / - and NCCL + norm's - / - / 66.3 (`bench all-reduce`, docs/results/gpu-parallel.md, the
    # final call of 2026-11-26). TOKENMILL_ALL_REDUCE_NORM_PUSH=1: push, =0: pull.
    push = os.environ.get("TOKENMILL_ALL_REDUCE_NORM_PUSH", "").lower()
    if not push:
        return "lamport"
    return "push" if push in ("1", "true", "yes") else "pull"


def buffer_bytes(half_bytes: int, world: int, variant: str = "pull") -> int:
    if variant == "lamport":
        from tokenmill.distributed.all_reduce_norm_lamport import buffer_bytes as lamport_bytes
        return lamport_bytes(half_bytes)
    from tokenmill.distributed.all_reduce_norm_kernel import MAX_PROGRAMS
    return 2 * half_bytes + 4 * MAX_PROGRAMS * world


def reference(partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed in the partials' dtype, new residual in the residual's dtype): the sum of the ranks'
    partials in float32 in rank order, plus the residual, then HF's RMSNorm
    (`layers.norm.rms_norm_reference`) with its roundings."""
    dtype = partials[0].dtype
    total = partials[0].float()
    for p in partials[1:]:
        total = total + p.float()
    new_residual = (residual.float() + total).to(residual.dtype)
    h = new_residual.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return weight.to(dtype) * normed, new_residual


def _enable_group(symm_mem, group_name: str) -> None:
    """Older torch needs symmetric memory enabled per group; newer warns that it is not needed."""
    import warnings
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)


class FusedAllReduceNorm:
    """One rank's symmetric buffer for the fused kernel, its peers' addresses and its counters."""

    def __init__(self, buffers: list[torch.Tensor] | torch.Tensor, peer_addresses: list[int], rank: int,
                 limits: FusedNormLimits, variant: str = "pull") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant {variant!r}: expected one of {', '.join(VARIANTS)}")
        device = buffers.device if isinstance(buffers, torch.Tensor) else buffers[rank].device
        self.buffers = buffers  # kept alive: the kernel reads them through raw addresses
        self.rank, self.world, self.limits = rank, len(peer_addresses), limits
        self.peers = torch.tensor(peer_addresses, dtype=torch.int64, device=device)
        from tokenmill.distributed import all_reduce_norm_kernel, all_reduce_norm_lamport
        slots = all_reduce_norm_lamport.MAX_TILES if variant == "lamport" else all_reduce_norm_kernel.MAX_PROGRAMS
        self.counters = torch.zeros(slots, dtype=torch.int32, device=device)
        self._programs = all_reduce_norm_lamport.max_programs(device) if variant == "lamport" else 0
        # (row width, dtype) of the calls: where program p's rows sit in a half depends on them, and
        # the halves' safety (a rank rewrites a half only after its peers signalled that they
        # finished reading it) holds only between calls of one layout. The first call fixes it;
        # calls of another layout are refused (`applies`), after the self-test's barrier.
        self._row_layout: tuple[int, torch.dtype] | None = None
        self.variant = variant
        self.push = variant == "push"  # the kernel's push variant: a half holds one slot per rank
        # lamport: how a launch cuts the rows (`all_reduce_norm_lamport.tiles_for`), fixed with the
        # row layout; `set_lamport_tiles` changes it between calls (collective, `bench all-reduce`).
        self.lamport_tiles = None

    @staticmethod
    def create(group, device: torch.device, limits: FusedNormLimits | None = None,
               variant: str | None = None) -> FusedAllReduceNorm | None:
        """The symmetric buffer (signal slots zeroed on every rank before any use) and a first
        call checked against the expected result, or None (logged): the layers then all-reduce
        and norm apart."""
        if device.type != "cuda" or not wanted():
            return None
        try:
            import torch.distributed as dist
            import torch.distributed._symmetric_memory as symm_mem

            variant = variant or variant_wanted()
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            limits = limits or default_limits(variant, world)
            _enable_group(symm_mem, group.group_name)
            buffer = symm_mem.empty(buffer_bytes(limits.half_bytes, world, variant), dtype=torch.uint8, device=device)
            handle = symm_mem.rendezvous(buffer, group)
            self = FusedAllReduceNorm(buffer, [int(a) for a in handle.buffer_ptrs], rank, limits, variant)
            self._handle, self._group = handle, group
            self._reset()  # every rank's signal slots zero (lamport: sentinels) before anyone signals
            self._self_test()
        except Exception as e:  # noqa: BLE001 - any failure means: all-reduce and norm apart
            logger.warning("fused all-reduce + RMSNorm unavailable (%s: %s); the layers all-reduce, then norm",
                           type(e).__name__, e)
            return None
        logger.info("TP all-reduce fused with residual add + RMSNorm up to %d KiB (%s variant)",
                    self.max_message() >> 10, self.variant)
        return self

    def _reset(self) -> None:
        """Buffers and counters as new on every rank (collective: ends with a barrier). Lamport: every
        element the sentinel, since a program refills only its own tile of the layout it runs."""
        import torch.distributed as dist
        torch.cuda.synchronize(self.peers.device)
        dist.barrier(group=self._group)  # no peer still reads or writes the buffers
        if self.variant == "lamport":
            from tokenmill.distributed.all_reduce_norm_lamport import SENTINEL
            self.buffers.view(torch.int16).fill_(SENTINEL)
        else:
            self.buffers.zero_()
        self.counters.zero_()
        torch.cuda.synchronize(self.peers.device)
        dist.barrier(group=self._group)

    def _self_test(self) -> None:
        n = 1024
        dtypes = (torch.bfloat16,) if self.variant == "lamport" else (torch.bfloat16, torch.float32)
        for dtype in dtypes:
            x = torch.full((3, n), float(self.rank + 1), dtype=dtype, device=self.peers.device)
            residual = torch.ones(3, n, dtype=torch.float32, device=x.device)
            weight = torch.full((n,), 2.0, dtype=dtype, device=x.device)
            for _ in range(3):  # both halves, and back
                out, res = self(x, residual.clone(), weight, 0.0)
                expected_res = 1 + self.world * (self.world + 1) / 2
                if not (bool((res == expected_res).all()) and bool((out == 2.0).all())):
                    raise RuntimeError(f"fused all-reduce + norm gave residual {res[0, :2].tolist()} and output "
                                       f"{out[0, :2].tolist()}, expected {expected_res} and 2.0")
        self._reset()  # no test rows left where the model's layout reads (and no peer still reads them)

    def applies(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the kernel takes this call (else: all-reduce, then add + norm apart)."""
        from tokenmill.distributed.all_reduce_norm_kernel import MAX_PROGRAMS, num_programs
        if x.dim() != 2 or x.dtype not in _DTYPES or not x.is_contiguous() or x.device != self.peers.device:
            return False
        if self.variant == "lamport" and x.dtype == torch.float32:  # one 16-bit sentinel for the buffer
            return False
        rows, n = x.shape
        if self._row_layout is None:
            self._row_layout = (n, x.dtype)
            if self.variant == "lamport" and self.lamport_tiles is None:
                from tokenmill.distributed.all_reduce_norm_lamport import tiles_for
                self.lamport_tiles = tiles_for(n)
        elif self._row_layout != (n, x.dtype):
            return False
        if not (residual.shape == x.shape and residual.is_contiguous() and residual.dtype in (x.dtype, torch.float32)
                and weight.shape == (n,) and n <= _MAX_HIDDEN and x.numel() * x.element_size() <= self.max_message()):
            return False
        if self.variant == "lamport":
            from tokenmill.distributed.all_reduce_norm_lamport import fits
            return fits(rows, n, self.limits.half_bytes, self.world, self.lamport_tiles)
        return num_programs(rows, n) <= MAX_PROGRAMS

    def set_lamport_tiles(self, tiles) -> None:
        """Cut later calls' rows by `tiles` (`all_reduce_norm_lamport.LamportTiles`): a tile's rows and
        its counter change meaning, so every rank's buffer and counters start afresh (collective)."""
        self.lamport_tiles = tiles
        self._reset()

    def max_message(self) -> int:
        """Bytes of the largest partial the kernel takes (push, lamport: a half holds every rank's)."""
        half = self.limits.half_bytes // self.world if self.variant != "pull" else self.limits.half_bytes
        return min(self.limits.max_bytes, half)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed in x's dtype, residual updated in place): `reference` over the group's partials."""
        if self.variant == "lamport":
            from tokenmill.distributed import all_reduce_norm_lamport
            out = all_reduce_norm_lamport.launch(x, residual, weight, eps, self.peers, self.counters, self.rank,
                                                 self.world, self.limits.half_bytes, self._programs,
                                                 self.lamport_tiles)
            return out, residual
        from tokenmill.distributed.all_reduce_norm_kernel import launch
        out = launch(x, residual, weight, eps, self.peers, self.counters, self.rank, self.world,
                     self.limits.half_bytes, self.push)
        return out, residual
