"""The fused TP all-reduce + residual add + RMSNorm kernel under Triton's CPU interpreter.

Local tensors stand in for the peers' symmetric buffers: before rank r's launch the test puts
each peer's partial rows in that peer's buffer (in the half the call uses) and the peer's signal
in r's slots, as the peer's own launch would have; the kernel must then sum every rank's rows
(its own copied in), add the residual, norm, signal every peer, and advance its counters. bf16
and the real cross-GPU barrier are checked on two GPUs (scripts/gpu_layouts.py --parts allreduce).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the first import

import pytest
import torch

from tests.helpers.triton_required import require_triton

require_triton()

from tokenmill.distributed import all_reduce_norm_kernel as kernel  # noqa: E402
from tokenmill.distributed.all_reduce_norm import (  # noqa: E402
    FusedAllReduceNorm,
    FusedNormLimits,
    buffer_bytes,
    reference,
)
from tokenmill.layers.norm import rms_norm_reference  # noqa: E402

HALF = 1 << 14  # bytes per half of a rank's buffer (small: the interpreter is slow)


def make_group(world: int, push: bool = False) -> list[FusedAllReduceNorm]:
    """One `FusedAllReduceNorm` per simulated rank, over CPU buffers that stand in for the peers'."""
    buffers = [torch.zeros(buffer_bytes(HALF, world), dtype=torch.uint8) for _ in range(world)]
    addresses = [b.data_ptr() for b in buffers]
    return [FusedAllReduceNorm(buffers, addresses, r, FusedNormLimits(half_bytes=HALF, max_bytes=HALF),
                               "push" if push else "pull") for r in range(world)]


def slot_start(rank: FusedAllReduceNorm, writer: int, call: int, dtype: torch.dtype) -> int:
    """Where `writer`'s rows of call `call` start in a buffer (elements): its own buffer's half, or
    (push) its slot in the half of the buffer it pushed to."""
    half = HALF // torch.empty(0, dtype=dtype).element_size()
    return (call % 2) * half + (writer * (half // rank.world) if rank.push else 0)


def signals(buffer: torch.Tensor) -> torch.Tensor:
    return buffer[2 * HALF:].view(torch.int32)


def play_peers(ranks: list[FusedAllReduceNorm], rank: int, partials: list[torch.Tensor], call: int) -> None:
    """What the other ranks' launches of call `call` leave behind before `rank`'s reads."""
    world, (rows, n) = len(ranks), partials[0].shape
    programs = kernel.num_programs(rows, n)
    for peer in range(world):
        if peer == rank:
            continue
        holder = rank if ranks[rank].push else peer  # push: the peer stored its rows into this rank's buffer
        data = ranks[holder].buffers[holder][:2 * HALF].view(partials[0].dtype)
        start = slot_start(ranks[rank], peer, call, partials[0].dtype)
        data[start:start + rows * n] = partials[peer].reshape(-1)
        signals(ranks[rank].buffers[rank]).view(-1, world)[:programs, peer] = call + 1


@pytest.mark.parametrize("push", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("world,rows,n", [(2, 1, 64), (2, 5, 96), (4, 3, 32)])
def test_fused_kernel_equals_the_torch_reference(dtype, world, rows, n, push):
    torch.manual_seed(0)
    ranks = make_group(world, push)
    weight = torch.randn(n).to(dtype)
    eps = 1e-5
    for call in range(3):  # halves 0, 1, 0: the counters pick them
        partials = [torch.randn(rows, n).to(dtype) for _ in range(world)]
        residual = torch.randn(rows, n) * 3
        want_out, want_res = reference(partials, residual, weight, eps)
        for rank in range(world):
            play_peers(ranks, rank, partials, call)
            res = residual.clone()
            out, res_out = ranks[rank](partials[rank], res, weight, eps)
            assert res_out is res  # updated in place
            torch.testing.assert_close(res, want_res, rtol=1e-6, atol=1e-5)
            if dtype == torch.float32:
                torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
            else:  # within one rounding of the half-precision output
                torch.testing.assert_close(out, want_out, rtol=2e-3, atol=2e-3)
            programs = kernel.num_programs(rows, n)
            assert (ranks[rank].counters[:programs] == call + 1).all()
            assert (ranks[rank].counters[programs:] == 0).all()
            for peer in range(world):  # this rank's signal reached every rank's slot [p, rank]
                slots = signals(ranks[peer].buffers[peer]).view(-1, world)
                assert (slots[:programs, rank] == call + 1).all()
            start = slot_start(ranks[rank], rank, call, dtype)
            for holder in range(world) if push else [rank]:  # push: its rows in every rank's buffer
                data = ranks[holder].buffers[holder][:2 * HALF].view(dtype)
                assert torch.equal(data[start:start + rows * n].view(rows, n), partials[rank])


def test_reference_is_the_sum_then_hf_rms_norm():
    torch.manual_seed(1)
    partials = [torch.randn(4, 48, dtype=torch.float16) for _ in range(2)]
    residual, weight = torch.randn(4, 48), torch.randn(48, dtype=torch.float16)
    out, res = reference(partials, residual, weight, 1e-6)
    torch.testing.assert_close(res, residual + partials[0].float() + partials[1].float())
    assert torch.equal(out, rms_norm_reference(res, weight, 1e-6, torch.float16))


def test_what_the_kernel_does_not_take():
    rank = make_group(2)[0]
    x, res, w = torch.zeros(2, 64), torch.zeros(2, 64), torch.zeros(64)
    assert rank.applies(x, res, w)
    # One row layout per buffer (the halves' safety holds between calls of one layout).
    assert not rank.applies(torch.zeros(2, 32), torch.zeros(2, 32), torch.zeros(32))
    assert not rank.applies(x.half(), res, w.half())
    assert not rank.applies(torch.zeros(HALF // 4 // 64 + 1, 64), torch.zeros(HALF // 4 // 64 + 1, 64), w)  # > half
    assert not rank.applies(x.t(), res.t(), torch.zeros(2))  # not contiguous
    assert not rank.applies(x, torch.zeros(2, 64, dtype=torch.float16), w)  # residual neither float32 nor x's
    assert not rank.applies(x.to(torch.int32), res, w)
    # Push: a half holds every rank's rows, so the message may fill half of it at two ranks.
    rows = HALF // 4 // 64 // 2 + 1
    big = torch.zeros(rows, 64)
    assert make_group(2)[0].applies(big, big, w) and not make_group(2, push=True)[0].applies(big, big, w)
    assert make_group(2, push=True)[0].applies(big[:-1], big[:-1], w)


def test_off_cuda_there_is_none(monkeypatch):
    assert FusedAllReduceNorm.create(None, torch.device("cpu")) is None
    monkeypatch.setenv("TOKENMILL_FUSED_ALL_REDUCE_NORM", "0")
    assert FusedAllReduceNorm.create(None, torch.device("cuda", 0)) is None


def test_the_decoder_layers_norm_takes_the_row_parallel_partial(monkeypatch):
    """The shared layers' wiring: a row-parallel linear marked `defer_reduce` hands its partial sum
    on (`PendingAllReduce`), and `RMSNorm.forward_with_residual` runs the fused kernel on it (rank 0
    of two; the peer's partial played into its buffer); too large for the buffer, the norm
    all-reduces first (here: adds the peer's partial) and norms apart."""
    from tokenmill.config import ModelArch, ParallelConfig
    from tokenmill.distributed.layout import RankLayout
    from tokenmill.distributed.parallel_state import ParallelContext, PendingAllReduce
    from tokenmill.layers.norm import RMSNorm
    from tokenmill.layers.parallel_linear import RowParallelLinear

    torch.manual_seed(2)
    n, inner, rows = 32, 16, 3
    arch = ModelArch(architecture="LlamaForCausalLM", model_type="llama", vocab_size=64, hidden_size=n,
                     intermediate_size=2 * inner, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
                     rms_norm_eps=1e-5, max_position=64)
    ranks = make_group(2)
    parallel = ParallelContext(RankLayout.of(arch, ParallelConfig(tensor_parallel_size=2), 0), fused_norm=ranks[0])
    linear = RowParallelLinear(inner, n, False, parallel)
    torch.nn.init.normal_(linear.weight)
    norm = RMSNorm(n, 1e-5)
    torch.nn.init.normal_(norm.weight)
    x, peer_partial, residual = torch.randn(rows, inner), torch.randn(rows, n), torch.randn(rows, n)
    partial = x @ linear.weight.t()
    want_out, want_res = reference([partial, peer_partial], residual, norm.weight.data, 1e-5)

    monkeypatch.setattr(parallel, "all_reduce", lambda t: t + 1.0)  # stands in for the group's sum
    torch.testing.assert_close(linear(x), partial + 1.0)  # not marked: reduced at once
    linear.defer_reduce = True
    pending = linear(x)
    assert isinstance(pending, PendingAllReduce)
    play_peers(ranks, 0, [partial, peer_partial], call=0)
    out, res = norm.forward_with_residual(pending, residual.clone())
    torch.testing.assert_close(res, want_res)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert (ranks[0].counters[:1] == 1).all()

    big = torch.randn(HALF // 4 // n + 1, inner)  # over half the buffer: all-reduce, then add + norm
    out, res = norm.forward_with_residual(linear(big), torch.zeros(big.shape[0], n))
    torch.testing.assert_close(res, big @ linear.weight.t() + 1.0)
    assert (ranks[0].counters[:1] == 1).all()  # the kernel did not run
