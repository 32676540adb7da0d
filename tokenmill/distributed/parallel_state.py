"""The process groups of one rank and the communication the model and the stages need.

Every rank joins one world group, then (all ranks, in the same order, as torch requires) one
TP group per pipeline stage and one PP group per TP index. Layers call `all_reduce` and
`all_gather_last_dim` on the TP group; pipeline stages hand activations to the next stage's
rank with the same TP index (`send_next` / `recv_prev`). gloo on CPU, NCCL on CUDA. With
tp = pp = 1 nothing is initialized and every collective is the identity.

tokenmill keeps no global state here: the worker makes a `ParallelContext` and hands it to the
model (torch.distributed's own default group lives in the worker process, which has one rank).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from tokenmill.config import ModelArch, ParallelConfig
from tokenmill.distributed.all_reduce_norm import FusedAllReduceNorm
from tokenmill.distributed.layout import RankLayout, split_from_halves
from tokenmill.distributed.p2p_order import P2POrderLog
from tokenmill.distributed.stage_balance import (StageCosts, balanced_halves, balanced_partition, explain,
                                                 explain_halves)
from tokenmill.distributed.symm_all_reduce import SymmetricAllReduce

logger = logging.getLogger(__name__)

_INIT_TIMEOUT = timedelta(minutes=10)
MAX_SENDS_IN_FLIGHT = 4  # pipeline steps whose activations may be on their way to the next stage at once


class PendingAllReduce:
    """A row-parallel linear's partial sum whose all-reduce waits for the RMSNorm after it, so
    both run as one kernel (`ParallelContext.all_reduce_add_norm`). Only layers that hand their
    output straight to `forward_with_residual` ask for it (`RowParallelLinear.defer_reduce`);
    `result()` is the plain all-reduce for any other consumer."""

    __slots__ = ("partial", "parallel")

    def __init__(self, partial: torch.Tensor, parallel: ParallelContext) -> None:
        self.partial, self.parallel = partial, parallel

    def result(self) -> torch.Tensor:
        return self.parallel.all_reduce(self.partial)


class StartedAllReduce:
    """A row-parallel linear's partial sum whose all-reduce is already on its way while the caller
    goes on computing: NCCL / gloo on the collective's own stream (`work`), or the symmetric
    buffer's kernel on the TP side stream (`done`, its event; capturable in a CUDA graph). `result()` makes
    the current stream wait for it (no host sync on CUDA) and returns the sum. Made by
    `RowParallelLinear` inside `ParallelContext.starting_reduces()` (`model/tp_overlap.py`: one
    half of a batch's all-reduce runs under the other half's GEMMs)."""

    __slots__ = ("tensor", "work", "done", "source")

    def __init__(self, tensor: torch.Tensor, work, done=None, source: torch.Tensor | None = None) -> None:
        # `done`: the side stream's event after this all-reduce (a join waits for it alone, not for
        # the other half's, started later). `source`: the partial the side stream reads, kept
        # alive until the current stream has joined (its memory is reused only after the read).
        self.tensor, self.work, self.done, self.source = tensor, work, done, source

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.done is not None:
            torch.cuda.current_stream(self.tensor.device).wait_event(self.done)
            self.done = self.source = None
        return self.tensor


def reduced(x: torch.Tensor | PendingAllReduce | StartedAllReduce) -> torch.Tensor:
    """x, all-reduced if it is still pending (or waited for, if started)."""
    return x.result() if isinstance(x, (PendingAllReduce, StartedAllReduce)) else x


def _measured_partition(probe: Callable[[], StageCosts] | None, stages: int, num_layers: int,
                        device: torch.device) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Rank 0 (the one given `probe`) measures and chooses; every rank receives its choice:
    (layers per stage, split boundaries), in half layers where the probe timed the attention
    halves (`StageCosts.attention`: the model's layers can be split), else whole layers."""
    choice = torch.zeros(stages + 1, dtype=torch.int64, device=device)  # counts, then 1: they are halves
    if probe is not None:
        costs = probe()
        if costs.attention:
            halves = balanced_halves(costs, stages)
            logger.info("pipeline partition by measured time, half layers: %s", explain_halves(costs, halves))
            choice.copy_(torch.tensor([*halves, 1], dtype=torch.int64))
        else:
            partition = balanced_partition(costs, stages)
            logger.info("pipeline partition by measured time: %s", explain(costs, partition))
            choice.copy_(torch.tensor([*partition, 0], dtype=torch.int64))
    dist.broadcast(choice, src=0)
    *counts, in_halves = (int(c) for c in choice.tolist())
    partition, split = split_from_halves(tuple(counts)) if in_halves else (tuple(counts), ())
    if sum(partition) != num_layers or min(counts) < (2 if in_halves else 1):
        raise RuntimeError(f"measured pipeline partition {counts} does not cover the {num_layers} layers")
    return partition, split if any(split) else ()


def _connect_token_pair(group, layout: RankLayout, device: torch.device) -> None:
    """One token from the last stage to the first on the device tokens' group, now, on both
    ranks. NCCL connects a pair lazily, at its first send / receive, and the sender's host then
    blocks until the receiver's host posts its own: the last stage's first token send sat in
    `isend` while the first stage, whose first receive comes only with its next step, waited for
    the core, which waited for that send's step (two H100s, mid-session stacks)."""
    first = layout.tp_rank
    last = (layout.pp_size - 1) * layout.tp_size + layout.tp_rank
    token = torch.zeros(1, dtype=torch.int64, device=device)
    if layout.is_first_stage:
        dist.irecv(token, src=last, group=group).wait()
    else:
        dist.isend(token, dst=first, group=group).wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ParallelContext:
    def __init__(self, layout: RankLayout, tp_group=None, pp_group=None, backend: str | None = None,
                 symm: SymmetricAllReduce | None = None, fused_norm: FusedAllReduceNorm | None = None) -> None:
        self.layout = layout
        self.tp_group = tp_group
        self.pp_group = pp_group
        self.backend = backend
        self.symm = symm  # small TP all-reduces over peer buffers (CUDA); None: NCCL / gloo only
        self.fused_norm = fused_norm  # all-reduce + residual add + RMSNorm in one kernel (CUDA); None: apart
        # Measurement only (`bench throughput` with TOKENMILL_BENCH_SKIP_ALL_REDUCE=1): TP steps
        # without their all-reduces, to time what the all-reduces cost a step. Wrong results.
        self.skip_all_reduce = os.environ.get("TOKENMILL_BENCH_SKIP_ALL_REDUCE") == "1"
        if self.skip_all_reduce and layout.tp_size > 1:
            logger.warning("TOKENMILL_BENCH_SKIP_ALL_REDUCE=1: TP all-reduces are skipped, outputs are WRONG "
                           "(for timing the all-reduce only)")
        self.token_group = None  # pipeline device tokens: this first / last stage rank and its peer
        self._sends: list[list] = []  # per step sent and not yet retired: its (work, tensor) pairs
        self.p2p_log: P2POrderLog | None = None  # tests: the order of this rank's sends and receives
        # Inside `starting_reduces()`: row-parallel linears start their all-reduce and return a
        # `StartedAllReduce` (the TP overlap of model/tp_overlap.py).
        self.starts_reduces = False
        self._side_stream = None  # CUDA: where started all-reduces over the symmetric buffer run

    @staticmethod
    def single(arch: ModelArch) -> ParallelContext:
        return ParallelContext(RankLayout.single(arch))

    @staticmethod
    def init(arch: ModelArch, parallel: ParallelConfig, rank: int, init_method: str,
             device: torch.device, probe: Callable[[], StageCosts] | None = None,
             device_tokens: bool = False) -> ParallelContext:
        """Join the world (blocks until every rank has) and build this rank's groups. With
        `parallel.balance_stages`, rank 0 runs `probe` (times of a layer, the embedding and the
        LM head) and every rank takes the partition balanced by them. `device_tokens`: a group of
        each first-stage rank and its last-stage peer, for sampled tokens (`pp_tokens.py`)."""
        if parallel.world_size == 1:
            return ParallelContext(RankLayout.of(arch, parallel, rank))
        backend = "nccl" if device.type == "cuda" else "gloo"
        options = {"device_id": device} if device.type == "cuda" and device.index is not None else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=parallel.world_size,
                                timeout=_INIT_TIMEOUT, **options)
        if parallel.balance_stages and probe is not None:
            partition, split = _measured_partition(probe if rank == 0 else None, parallel.pipeline_parallel_size,
                                                   arch.num_layers, device)
            parallel = msgspec.structs.replace(parallel, layer_partition=partition, split_attention=split)
        layout = RankLayout.of(arch, parallel, rank)
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        tp_group = pp_group = None
        for stage in range(pp):  # every rank creates every group, in the same order
            group = dist.new_group([stage * tp + r for r in range(tp)], backend=backend)
            if stage == layout.pp_stage:
                tp_group = group
        for r in range(tp):
            group = dist.new_group([stage * tp + r for stage in range(pp)], backend=backend)
            if r == layout.tp_rank:
                pp_group = group
        token_group = None
        if device_tokens and pp > 1:  # its own communicator: its own stream, apart from the activations
            for r in range(tp):
                group = dist.new_group([r, (pp - 1) * tp + r], backend=backend)
                if r == layout.tp_rank and (layout.is_first_stage or layout.is_last_stage):
                    token_group = group
        logger.info("rank %d: tp rank %d/%d, pp stage %d/%d, layers [%d, %d)%s%s (%s)", rank, layout.tp_rank, tp,
                    layout.pp_stage, pp, layout.layer_start, layout.layer_end,
                    f", layer {layout.layer_start}'s MLP only" if layout.lends_attention else "",
                    f", plus layer {layout.layer_end}'s attention" if layout.borrows_attention else "", backend)
        symm = SymmetricAllReduce.create(tp_group, device) if tp > 1 else None
        fused_norm = FusedAllReduceNorm.create(tp_group, device) if tp > 1 else None
        context = ParallelContext(layout, tp_group, pp_group, backend, symm, fused_norm)
        context.token_group = token_group
        context.p2p_log = P2POrderLog.from_env(rank)
        if token_group is not None:
            _connect_token_pair(token_group, layout, device)
        return context

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    # ------------------------------------------------------------------ tensor parallel

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the TP group: the result is returned (in place in `x` through NCCL / gloo, a new
        tensor through the symmetric buffer). No host sync: capturable in a CUDA graph."""
        if self.tp_size == 1 or self.skip_all_reduce:
            return x
        if self.symm is not None and x.is_contiguous():
            method = self.symm.method_for(x)
            if method != "nccl":
                return self.symm.all_reduce(x, method)
        dist.all_reduce(x, group=self.tp_group)
        return x

    def side_all_reduce_fits(self, x: torch.Tensor) -> bool:
        """Whether `start_all_reduce(x)` takes the symmetric buffer on the side stream (the only
        way it may run inside a CUDA graph being captured)."""
        return self.symm is not None and x.is_contiguous() and self.symm.method_for(x) != "nccl"

    def start_all_reduce(self, x: torch.Tensor) -> StartedAllReduce:
        """Start the sum over the TP group of `x` and return at once; the caller's stream waits only
        at `result()`. Messages the symmetric buffer takes: its kernel on the TP side stream, after
        the work queued so far on the current stream (the sum in a new tensor); others: NCCL / gloo
        on the collective's own stream (in place)."""
        if self.tp_size == 1 or self.skip_all_reduce:
            return StartedAllReduce(x, None)
        if self.side_all_reduce_fits(x):
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device=x.device, priority=-1)
            out, done = self.symm.start(x, self._side_stream)
            return StartedAllReduce(out, None, done, x)
        return StartedAllReduce(x, dist.all_reduce(x, group=self.tp_group, async_op=True))

    @contextlib.contextmanager
    def starting_reduces(self):
        """Row-parallel linears called inside start their all-reduce (`start_all_reduce`)."""
        previous, self.starts_reduces = self.starts_reduces, True
        try:
            yield
        finally:
            self.starts_reduces = previous

    def defers_reduce(self) -> bool:
        """Whether row-parallel linears that feed an RMSNorm leave the all-reduce to it
        (`PendingAllReduce`): only where the fused kernel exists and the all-reduce is real."""
        return self.fused_norm is not None and self.tp_size > 1 and not self.skip_all_reduce

    def all_reduce_add_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(RMSNorm of residual + sum of the group's partials, that new residual) in one kernel, the
        residual updated in place; None where the kernel does not take it (the caller reduces)."""
        if self.fused_norm is None or not self.fused_norm.applies(partial, residual, weight):
            return None
        return self.fused_norm(partial, residual, weight, eps)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., tp * n], ranks in order."""
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        if self.backend == "nccl":
            out = torch.empty((self.tp_size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.tp_group)
            if x.numel() == x.shape[-1]:  # one row (batch-1 logits): the ranks' parts already lie in order
                return out.view(*x.shape[:-1], self.tp_size * x.shape[-1])
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.tp_size)]
            dist.all_gather(parts, x, group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def all_gather_stacked(self, x: torch.Tensor) -> torch.Tensor:
        """[tp, *x.shape]: every rank's `x`, ranks in order (capturable on CUDA)."""
        if self.tp_size == 1:
            return x[None]
        x = x.contiguous()
        out = torch.empty((self.tp_size, *x.shape), dtype=x.dtype, device=x.device)
        if self.backend == "nccl":
            dist.all_gather_into_tensor(out, x, group=self.tp_group)
        else:
            dist.all_gather(list(out.unbind(0)), x, group=self.tp_group)
        return out

    # ------------------------------------------------------------------ pipeline parallel

    def send_next(self, tensors: list[torch.Tensor]) -> None:
        """Start sending to the next stage; returns at once, with no host sync and nothing for the
        compute stream to wait on: a send that has not completed (its peer has not posted the
        matching receive yet) must not hold back this stage's next step. Sends on their way keep
        their tensors alive; the completed ones are retired here (a non-blocking query), and only
        past `MAX_SENDS_IN_FLIGHT` steps is the oldest waited for (a stream wait, not a host one)."""
        self._retire_sends()
        dst = self.layout.next_stage_rank
        if self.p2p_log is not None:
            self.p2p_log.record(dst, "send", "act")
        self._sends.append([(dist.isend(t.contiguous(), dst=dst, group=self.pp_group), t) for t in tensors])

    def _retire_sends(self) -> None:
        while self._sends and (len(self._sends) >= MAX_SENDS_IN_FLIGHT
                               or all(work.is_completed() for work, _ in self._sends[0])):
            for work, _ in self._sends.pop(0):
                work.wait()

    def wait_sends(self) -> None:
        for sends in self._sends:
            for work, _ in sends:
                work.wait()
        self._sends = []

    def recv_prev(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """Receive the previous stage's activations (blocks until they arrive)."""
        out = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
        src = self.layout.prev_stage_rank
        if self.p2p_log is not None:
            self.p2p_log.record(src, "recv", "act")
        works = [dist.irecv(t, src=src, group=self.pp_group) for t in out]
        for work in works:
            work.wait()
        return out

    def destroy(self) -> None:
        """Leave the groups (at shutdown; a send still on its way is dropped: its peer stops too)."""
        self._sends = []
        if self.p2p_log is not None:
            self.p2p_log.write()
        if self.backend is not None and dist.is_initialized():  # only what `init` set up
            dist.destroy_process_group()
