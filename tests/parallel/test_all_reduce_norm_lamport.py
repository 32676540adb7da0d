"""The fused all-reduce + add + RMSNorm's lamport variant under Triton's CPU interpreter.

Local tensors stand in for the peers' buffers. Before rank r's launch of call c the test stores
each peer's rows (with -0.0 turned into +0.0, as the peer's launch does) into the peer's slot of
epoch c % 3 of r's buffer; the kernel must sum the ranks' rows in rank order (its own from
registers), add the residual and norm, store its own rows into every peer's buffer, refill its
tile of epoch (c + 2) % 3 with the sentinel and advance its counters. Reading a slot that still
holds the sentinel would spin for ever, so the test plays every peer before each launch. The real
cross-GPU exchange is checked on two GPUs (scripts/gpu_layouts.py --parts allreduce).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the first import

import pytest
import torch

from tests.helpers.triton_required import require_triton

require_triton()

from tokenmill.distributed import all_reduce_norm_lamport as lamport  # noqa: E402
from tokenmill.distributed.all_reduce_norm import FusedAllReduceNorm, FusedNormLimits, reference  # noqa: E402

HALF = 1 << 16  # bytes per epoch of a rank's buffer (small: the interpreter is slow)


def make_group(world: int) -> list[FusedAllReduceNorm]:
    buffers = [torch.full((lamport.buffer_bytes(HALF) // 2,), lamport.SENTINEL, dtype=torch.int16)
               for _ in range(world)]
    addresses = [b.data_ptr() for b in buffers]
    return [FusedAllReduceNorm(buffers, addresses, r, FusedNormLimits(half_bytes=HALF, max_bytes=HALF), "lamport")
            for r in range(world)]


def slot(ranks, owner: int, writer: int, epoch: int) -> torch.Tensor:
    """`writer`'s slot of an epoch in `owner`'s buffer (int16 elements)."""
    world = len(ranks)
    elems = lamport.slot_elements(HALF, world)
    start = ((epoch % 3) * world + writer) * elems
    return ranks[owner].buffers[owner][start:start + elems]


def wire(x: torch.Tensor) -> torch.Tensor:
    """A partial's bits as a rank sends them: -0.0 as +0.0."""
    bits = x.contiguous().view(torch.int16).reshape(-1).clone()
    bits[bits == lamport.SENTINEL] = 0
    return bits


@pytest.mark.parametrize("dtype", [torch.float16])
# n=2048: one row per tile, so up to 6 tiles share the interpreter's 2 programs (`max_programs`),
# and the tiles' call counts (epochs) drift apart as the row count varies.
# tiles: the default launch shape, or another (`LamportTiles`: rows per tile, warps, programs per SM;
# `bench all-reduce --lamport-tiles` times them on the GPUs).
@pytest.mark.parametrize("world,rows_per_call,n,tiles", [
    (2, (1, 3, 1, 2), 64, None), (2, (5, 2, 6, 1), 2048, None), (2, (2, 1), 96, None), (3, (3, 1, 4, 2), 32, None),
    (2, (5, 2, 9, 1), 64, "4:2:1"), (2, (3, 1, 2), 96, "1:4:2:pdl"), (2, (5, 2, 6, 1), 2048, "1:4:1:pre"),
    (3, (3, 1, 4), 32, "2:2:1:pdl+pre")])
def test_lamport_kernel_equals_the_torch_reference(dtype, world, rows_per_call, n, tiles):
    torch.manual_seed(0)
    ranks = make_group(world)
    if tiles is not None:
        for r in ranks:
            r.lamport_tiles = lamport.LamportTiles.parse(tiles)
    weight = torch.randn(n).to(dtype)
    eps = 1e-5
    tile_rows = lamport.tiles_for(n).rows if tiles is None else lamport.LamportTiles.parse(tiles).rows
    tile_elems = tile_rows * n
    calls_of_tile = [0] * 64  # per tile: how often it ran (its epoch), the same on every rank
    for rows in rows_per_call:
        partials = [torch.randn(rows, n).to(dtype) for _ in range(world)]
        partials[0][0, :3] = -0.0  # sent as +0.0: the peers must not wait on them
        residual = torch.randn(rows, n) * 3
        want_out, want_res = reference(partials, residual, weight, eps)
        tiles = -(-rows // tile_rows)

        def region(owner: int, writer: int, t: int, epoch_shift: int = 0) -> torch.Tensor:
            return slot(ranks, owner, writer, calls_of_tile[t] + epoch_shift)[t * tile_elems:(t + 1) * tile_elems]

        for rank in range(world):
            for peer in range(world):  # what the peers' launches leave in this rank's buffer
                if peer != rank:
                    sent = wire(partials[peer])
                    for t in range(tiles):
                        part = sent[t * tile_elems:(t + 1) * tile_elems]
                        region(rank, peer, t)[:part.numel()] = part
            assert ranks[rank].applies(partials[rank], residual, weight)
            res = residual.clone()
            out, res_out = ranks[rank](partials[rank], res, weight, eps)
            assert res_out is res
            torch.testing.assert_close(res, want_res, rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(out, want_out, rtol=2e-3, atol=2e-3)
            assert (ranks[rank].counters[:tiles] == torch.tensor(calls_of_tile[:tiles]) + 1).all()
            assert (ranks[rank].counters[tiles:64] == torch.tensor(calls_of_tile[tiles:])).all()
            sent = wire(partials[rank])
            for peer in range(world):
                if peer == rank:
                    continue
                for t in range(tiles):  # its rows, as sent, in its slot of every peer's buffer
                    part = sent[t * tile_elems:(t + 1) * tile_elems]
                    assert torch.equal(region(peer, rank, t)[:part.numel()], part)
                    # the tile's stale epoch refilled with the sentinel, whatever an earlier call wrote there
                    assert (region(rank, peer, t, 2) == lamport.SENTINEL).all()
            for e in range(3):  # its own slot in its own buffer is never written
                assert (slot(ranks, rank, rank, e) == lamport.SENTINEL).all()
        for t in range(tiles):
            calls_of_tile[t] += 1


def test_lamport_tiles_from_text_and_environment(monkeypatch):
    monkeypatch.delenv("TOKENMILL_LAMPORT_TILES", raising=False)
    # the fastest of the shapes measured on two H100s (1:8:3:pdl), and its kind at other widths
    assert lamport.tiles_for(4096) == lamport.LamportTiles(1, 8, 3, pdl=True)
    assert lamport.tiles_for(64) == lamport.LamportTiles(32, 4, 3, pdl=True)
    monkeypatch.setenv("TOKENMILL_LAMPORT_TILES", "2:16:2")
    assert lamport.tiles_for(4096) == lamport.LamportTiles(2, 16, 2)
    assert lamport.LamportTiles.parse("1:16:1:pdl") == lamport.LamportTiles(1, 16, 1, pdl=True)
    assert lamport.LamportTiles.parse("1:16:1:pre+pdl") == lamport.LamportTiles(1, 16, 1, pdl=True, prefetch=True)
    for bad in ("3:16", "2", "2:12:1", "2:16:9", "a:b", "1:16:1:yes", "1:16:1:pdl:pre"):
        with pytest.raises(ValueError, match="lamport tiles"):
            lamport.LamportTiles.parse(bad)
    # programs: one per SM until the compiled kernel said how many fit (off CUDA: always the count given)
    assert lamport.programs(torch.device("cpu"), 4096, lamport.LamportTiles(1, 8, 4), 132) == 132


def test_what_the_lamport_variant_does_not_take():
    rank = make_group(2)[0]
    w = torch.zeros(64, dtype=torch.float16)
    x = torch.zeros(2, 64, dtype=torch.float16)
    assert rank.applies(x, x.float(), w)
    assert not make_group(2)[0].applies(x.float(), x.float(), w.float())  # one 16-bit sentinel: no float32
    tile = lamport.rows_per_program(64)  # a program's rows: its whole tile must lie in a slot
    rows = lamport.slot_elements(HALF, 2) // (tile * 64) * tile
    big = torch.zeros(rows + 1, 64, dtype=torch.float16)
    assert not make_group(2)[0].applies(big, big, w) and make_group(2)[0].applies(big[:-1], big[:-1], w)


def test_the_lamport_buffer_is_sized_for_its_largest_message(monkeypatch):
    from tokenmill.distributed.all_reduce_norm import FusedNormLimits, default_limits
    assert default_limits("pull", 2) == FusedNormLimits()
    monkeypatch.setenv("TOKENMILL_ALL_REDUCE_NORM_MAX_MIB", "64")  # a prefill chunk: 8192 tokens x 4096, bf16
    limits = default_limits("lamport", 2)
    assert limits.max_bytes == 64 << 20 and limits.half_bytes == 128 << 20
    assert lamport.fits(8192, 4096, limits.half_bytes, 2) and not lamport.fits(8193, 4096, limits.half_bytes, 2)


def test_which_variant_the_environment_asks_for(monkeypatch):
    from tokenmill.distributed.all_reduce_norm import variant_wanted
    monkeypatch.delenv("TOKENMILL_ALL_REDUCE_NORM_VARIANT", raising=False)
    monkeypatch.delenv("TOKENMILL_ALL_REDUCE_NORM_PUSH", raising=False)
    assert variant_wanted() == "lamport"  # measured fastest of the three
    monkeypatch.setenv("TOKENMILL_ALL_REDUCE_NORM_PUSH", "1")
    assert variant_wanted() == "push"
    monkeypatch.setenv("TOKENMILL_ALL_REDUCE_NORM_PUSH", "0")
    assert variant_wanted() == "pull"
    monkeypatch.setenv("TOKENMILL_ALL_REDUCE_NORM_VARIANT", "lamport")
    assert variant_wanted() == "lamport"
    monkeypatch.setenv("TOKENMILL_ALL_REDUCE_NORM_VARIANT", "ring")
    with pytest.raises(ValueError, match="TOKENMILL_ALL_REDUCE_NORM_VARIANT"):
        variant_wanted()


def test_programs_per_sm_from_the_compiled_kernel(monkeypatch):
    """Registers decide (sm_90 figures of the kernel at hidden 4096, compiled offline): 50 a thread
    at 16 warps -> 2 programs an SM, 80 at 8 warps -> 3; unknown registers -> 1."""
    from types import SimpleNamespace
    props = SimpleNamespace(regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                            shared_memory_per_multiprocessor=233472)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)

    def kernel(regs, shared):
        return SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(shared=shared))

    assert lamport.resident_per_sm(kernel(50, 16384), 16, None) == 2
    assert lamport.resident_per_sm(kernel(80, 8192), 8, None) == 3
    assert lamport.resident_per_sm(kernel(36, 8192), 32, None) == 1
    assert lamport.resident_per_sm(kernel(24, 120000), 4, None) == 1  # shared memory decides
    assert lamport.resident_per_sm(SimpleNamespace(), 16, None) == 1
