"""Batched LoRA kernels (Triton, under the CPU interpreter in float32 and float16: the per-token
and the tile kernels, K split or not) and the CPU path, against the per-token torch reference, on
small shapes with mixed slots (and tokens without an adapter); the step's tile plan."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before the first import

import pytest
import torch

from tests.helpers.triton_required import require_triton

require_triton()

from tokenmill.layers.lora import lora_layer, triton_fused, triton_lora  # noqa: E402
from tokenmill.layers.lora.lora_layer import LoRABatch, LoRASlots  # noqa: E402
from tokenmill.layers.lora.torch_lora import lora_add_grouped, lora_reference  # noqa: E402
from tokenmill.layers.lora.triton_expand import lora_expand  # noqa: E402
from tokenmill.layers.lora.triton_fused import lora_expand_silu  # noqa: E402
from tokenmill.layers.lora.triton_lora import plan_step, plan_tiles  # noqa: E402
from tokenmill.layers.lora.triton_shrink import lora_shrink  # noqa: E402

PARTS = {"qkv": [64, 32, 32], "gate_up": [48, 48], "single": [80]}


def _case(num_tokens: int, parts: list[int], slots: int = 3, rank: int = 16, k: int = 40, seed: int = 0,
          dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=g)
    a = torch.randn(slots, len(parts) * rank, k, generator=g) * 0.3
    b = torch.randn(slots, sum(parts), rank, generator=g) * 0.3
    token_slots = torch.randint(-1, slots, (num_tokens,), generator=g)
    y = torch.randn(num_tokens, sum(parts), generator=g)
    starts = tuple(int(v) for v in torch.tensor([0] + parts).cumsum(0))
    return x.to(dtype), a.to(dtype), b.to(dtype), token_slots, y.to(dtype), starts


@pytest.fixture(autouse=True)
def _many_sms(monkeypatch):
    """Size the K splits for a GPU of 64 SMs (the CPU counts as 4): the split paths run here."""
    monkeypatch.setattr(triton_lora, "_sm_count", lambda device: 64)


def _triton(x, a, b, token_slots, y, starts):
    n, k = a.shape[1], a.shape[2]
    plan = plan_step(token_slots, a.shape[0], {(n, k)})
    planes = lora_shrink(x, a, plan)
    return lora_expand(planes, b, plan, y.clone(), starts), plan, planes


# Tokens: 1 and 7 run the per-token (rows) kernels, 40 and 600 the tile kernels (16 and 64 rows a
# tile); K = 300 is split over programs (the expand adds the planes).
@pytest.mark.parametrize("num_tokens,k", [(1, 40), (1, 300), (7, 300), (40, 40), (40, 300), (600, 72)])
@pytest.mark.parametrize("shape", sorted(PARTS))
def test_triton_shrink_expand_match_reference(num_tokens, k, shape):
    x, a, b, token_slots, y, starts = _case(num_tokens, PARTS[shape], k=k)
    expected = y + lora_reference(x, a, b, starts, token_slots)
    out, plan, planes = _triton(x, a, b, token_slots, y, starts)
    assert (plan.order is None) == (num_tokens <= triton_lora.ROWS_MAX_TOKENS)
    if k == 300:
        assert planes.shape[0] > 1  # split K: the planes are summed by the expand
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    no_adapter = token_slots < 0
    assert torch.equal(out[no_adapter], y[no_adapter])  # rows without an adapter are untouched


@pytest.mark.parametrize("num_tokens,k", [(40, 40), (40, 300), (600, 72)])
@pytest.mark.parametrize("shape", sorted(PARTS))
def test_tile_expand_writes_the_delta_alone(num_tokens, k, shape):
    """`lora_expand(add=False)`: y becomes the delta alone, every row written (zeros for tokens
    without an adapter), whatever y held."""
    x, a, b, token_slots, y, starts = _case(num_tokens, PARTS[shape], k=k)
    plan = plan_step(token_slots, a.shape[0], {(a.shape[1], k)})
    out = lora_expand(lora_shrink(x, a, plan), b, plan, torch.full_like(y, float("nan")), starts, add=False)
    torch.testing.assert_close(out, lora_reference(x, a, b, starts, token_slots), atol=1e-4, rtol=1e-4)
    assert torch.equal(out[token_slots < 0], torch.zeros_like(out[token_slots < 0]))


@pytest.mark.parametrize("num_tokens", [5, 40])
def test_triton_float16(num_tokens):
    x, a, b, token_slots, y, starts = _case(num_tokens, PARTS["qkv"], k=200, seed=4, dtype=torch.float16)
    expected = y.float() + lora_reference(x, a, b, starts, token_slots)
    out, _, _ = _triton(x, a, b, token_slots, y, starts)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_tokens,k", [(1, 40), (7, 300), (40, 300), (600, 72)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_expand_fused_with_silu_and_mul(num_tokens, k, dtype):
    """gate_up's expand fused with the activation = SiLU-and-mul of (y + the reference's delta),
    also for tokens without an adapter (their activation, no delta)."""
    x, a, b, token_slots, y, starts = _case(num_tokens, [48, 48], k=k, seed=5, dtype=dtype)
    plan = plan_step(token_slots, a.shape[0], {(a.shape[1], k)})
    out = lora_expand_silu(lora_shrink(x, a, plan), b, plan, y)
    gate, up = (y.float() + lora_reference(x, a, b, starts, token_slots)).to(dtype).float().chunk(2, dim=1)
    expected = torch.nn.functional.silu(gate) * up
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_tokens,slots", [(17, 3), (40, 9), (600, 5), (530, 40)])
def test_tiles_cover_each_token_once(num_tokens, slots):
    """Every token is in exactly one tile, of its own slot (-1: without an adapter), of at most
    BLOCK_M rows; the tile count fits the static bound (worst case: every group ends a partial tile)."""
    g = torch.Generator().manual_seed(num_tokens)
    token_slots = torch.randint(-1, slots, (num_tokens,), generator=g)
    order, tiles, count = plan_tiles(token_slots, slots)
    block_m = triton_lora.tile_rows(num_tokens)
    seen = torch.zeros(num_tokens, dtype=torch.int64)
    for slot, first, end in tiles.t().tolist():
        if slot == triton_lora.NO_TILE:
            continue
        assert 0 < end - first <= block_m
        rows = order[first:end].long()
        assert (token_slots[rows] == slot).all()
        seen[rows] += 1
    assert torch.equal(seen, torch.ones(num_tokens, dtype=torch.int64))
    real = int((tiles[0] != triton_lora.NO_TILE).sum())
    assert (tiles[0, real:] == triton_lora.NO_TILE).all()  # real tiles first
    assert count.tolist() == [real]  # the kernels loop up to it


@pytest.mark.parametrize("num_tokens,slots", [(17, 3), (40, 9), (600, 5), (530, 40), (300, 64), (33, 1)])
def test_plan_kernel_equals_torch_plan(num_tokens, slots):
    """The one-launch plan (steps up to PLAN_KERNEL_MAX_TOKENS) = the torch ops' plan: the same
    stable order by slot, the same real tiles and count."""
    g = torch.Generator().manual_seed(num_tokens + slots)
    token_slots = torch.randint(-1, slots, (num_tokens,), generator=g)
    order, tiles, count = plan_tiles(token_slots, slots)
    order2, tiles2, count2 = triton_lora.plan_tiles_fused(token_slots, slots)
    real = int(count)
    assert torch.equal(count2, count) and torch.equal(order2, order)
    assert torch.equal(tiles2[:, :real], tiles[:, :real])
    assert (tiles2[0, real:] == triton_lora.NO_TILE).all()


@pytest.mark.parametrize("shape", sorted(PARTS))
def test_cpu_grouped_path_matches_reference(shape):
    x, a, b, token_slots, y, starts = _case(33, PARTS[shape], seed=1)
    batch = LoRABatch(torch.device("cpu"))
    batch.prepare(token_slots, token_slots.numpy())
    out = lora_add_grouped(x, y.clone(), a, b, starts, batch.groups)
    torch.testing.assert_close(out, y + lora_reference(x, a, b, starts, token_slots), atol=1e-5, rtol=1e-5)


def test_reference_is_plain_lora():
    """The reference itself: one token, one slot, against (x A^T) B^T written out per part."""
    x, a, b, _, _, starts = _case(1, PARTS["qkv"], slots=2, seed=2)
    slots = torch.tensor([1])
    delta = lora_reference(x, a, b, starts, slots)
    for i, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
        part_a = a[1, i * 16:(i + 1) * 16]
        torch.testing.assert_close(delta[0, lo:hi], (x[0] @ part_a.T) @ b[1, lo:hi].T, atol=1e-5, rtol=1e-5)


def test_slots_pad_lower_ranks_with_zeros():
    batch = LoRABatch(torch.device("cpu"))
    slots = LoRASlots(batch, 2, 16, 8, [16, 16], torch.float32, torch.device("cpu"))
    a, b = torch.randn(4, 8), torch.randn(16, 4)
    slots.set_slot(1, 1, a, b)
    x = torch.randn(3, 8)
    batch.prepare(torch.tensor([1, -1, 1]), torch.tensor([1, -1, 1]).numpy())
    y = slots.apply(x, torch.zeros(3, 32))
    torch.testing.assert_close(y[0, 16:], (x[0] @ a.T) @ b.T)
    assert not y[:, :16].any() and not y[1].any()


@pytest.mark.parametrize("num_tokens", [3, 40])
def test_layer_triton_path_matches_cpu_path(num_tokens):
    """`LoRASlots` on its Triton path (the plan a CUDA step would build, run by the interpreter):
    the plain projection hook and gate_up's fused activation equal the CPU path's."""
    g = torch.Generator().manual_seed(7)
    batch = LoRABatch(torch.device("cpu"), 3)
    slots = LoRASlots(batch, 3, 16, 40, [48, 48], torch.float32, torch.device("cpu"))
    for slot in range(3):
        for part in range(2):
            rank = 8 + 4 * slot
            slots.set_slot(slot, part, torch.randn(rank, 40, generator=g), torch.randn(48, rank, generator=g))
    x, y = torch.randn(num_tokens, 40, generator=g), torch.randn(num_tokens, 96, generator=g)
    token_slots = torch.randint(-1, 3, (num_tokens,), generator=g)
    batch.prepare(token_slots, token_slots.numpy())
    want = slots.forward(x, lambda: y.clone())  # the CPU path
    want_act = torch.nn.functional.silu(want[:, :48]) * want[:, 48:]
    batch.plan = plan_step(token_slots, 3, batch.shapes)
    torch.testing.assert_close(slots.forward(x, lambda: y.clone()), want, atol=1e-4, rtol=1e-4)
    act = slots.forward_silu_mul(x, lambda: y.clone(), lambda t: None)
    torch.testing.assert_close(act, want_act, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_rows_plan_of_one_row_chunk_reads_each_tokens_slot(fused):
    """A one-row prompt chunk's token slots arrive as an expanded (stride-0) view of the row's
    slot (the prompt-chunk graph's body): the rows kernels must see slot 1 for every token, not
    read past the one element (here into a neighbour holding slot 2; on CUDA into whatever lies
    there: the illegal address of gpu_lora's engine part)."""
    parts = [48, 48] if fused else PARTS["qkv"]
    x, a, b, _, y, starts = _case(16, parts, k=40, seed=6)
    memory = torch.full((32,), 2, dtype=torch.int32)
    memory[0] = 1
    token_slots = memory[:1][:, None].expand(-1, 16).reshape(-1)
    assert token_slots.stride(0) == 0  # what the body hands over: one element, read 16 times
    plan = plan_step(token_slots, a.shape[0], {(a.shape[1], 40)})
    assert plan.order is None  # the rows kernels
    delta = lora_reference(x, a, b, starts, torch.ones(16, dtype=torch.int64))
    planes = lora_shrink(x, a, plan)
    if fused:
        gate, up = (y + delta).chunk(2, dim=1)
        torch.testing.assert_close(lora_expand_silu(planes, b, plan, y), torch.nn.functional.silu(gate) * up,
                                   atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(lora_expand(planes, b, plan, y.clone(), starts), y + delta, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_tokens,inter", [(1, 48), (7, 48), (5, 608)])
def test_silu_kernel_does_the_next_shrink(num_tokens, inter):
    """At decode sizes gate_up's fused expand + activation also does down_proj's shrink of its own
    output (one launch less): down_proj's LoRA then equals the unfused path's (and the CPU path's),
    tokens without an adapter untouched. inter = 608: three column blocks, three planes summed."""
    g = torch.Generator().manual_seed(11)
    batch = LoRABatch(torch.device("cpu"), 3)
    gate_up = LoRASlots(batch, 3, 16, 40, [inter, inter], torch.float32, torch.device("cpu"))
    down = LoRASlots(batch, 3, 16, inter, [32], torch.float32, torch.device("cpu"))
    for slot in range(3):
        for part in range(2):
            gate_up.set_slot(slot, part, torch.randn(8, 40, generator=g), torch.randn(inter, 8, generator=g) * 0.3)
        down.set_slot(slot, 0, torch.randn(16, inter, generator=g) * 0.1, torch.randn(32, 16, generator=g))
    x, y = torch.randn(num_tokens, 40, generator=g), torch.randn(num_tokens, 2 * inter, generator=g)
    token_slots = torch.tensor([(-1, 2, 0, 1)[t % 4] for t in range(num_tokens)]) if num_tokens > 1 else \
        torch.tensor([2])
    residual = torch.randn(num_tokens, 32, generator=g)
    batch.prepare(token_slots, token_slots.numpy())  # the CPU path
    act = torch.nn.functional.silu(gate_up.forward(x, lambda: y.clone())[:, :inter]) * \
        gate_up.forward(x, lambda: y.clone())[:, inter:]
    want = down.forward(act, lambda: residual.clone())
    batch.plan = plan_step(token_slots, 3, batch.shapes)
    assert batch.plan.order is None
    out = gate_up.forward_silu_mul(x, lambda: y.clone(), None, then=down)
    assert batch.ahead is not None and batch.ahead[0] is out  # the shrink was done ahead
    torch.testing.assert_close(out, act, atol=1e-4, rtol=1e-4)
    got = down.forward(out, lambda: residual.clone())
    assert batch.ahead is None  # consumed
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    no_adapter = token_slots < 0
    assert torch.equal(got[no_adapter], residual[no_adapter])
    # Another input than the kernel's output: down_proj does its own shrink (the planes ahead are not reused).
    gate_up.forward_silu_mul(x, lambda: y.clone(), None, then=down)
    other = act + 1.0
    batch.prepare(token_slots, token_slots.numpy())
    want_other = down.forward(other, lambda: residual.clone())
    batch.plan = plan_step(token_slots, 3, batch.shapes)
    gate_up.forward_silu_mul(x, lambda: y.clone(), None, then=down)
    torch.testing.assert_close(down.forward(other, lambda: residual.clone()), want_other, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_sink_gets_the_delta_and_y_stays_base(num_tokens, monkeypatch):
    """With a sink (the float32 stream o_proj's / down_proj's output is added to next), the Triton
    path adds the deltas there and returns base() untouched: y + sink equals the CPU path's; with
    down_proj's shrink done ahead by gate_up's kernel (decode sizes) as well."""
    monkeypatch.setattr(lora_layer, "SINK_MODE", "always")  # (by default only beside the GEMM: CUDA graphs)
    g = torch.Generator().manual_seed(13)
    batch = LoRABatch(torch.device("cpu"), 3)
    gate_up = LoRASlots(batch, 3, 16, 40, [48, 48], torch.float32, torch.device("cpu"))
    down = LoRASlots(batch, 3, 16, 48, [32], torch.float32, torch.device("cpu"))
    for slot in range(3):
        for part in range(2):
            gate_up.set_slot(slot, part, torch.randn(8, 40, generator=g), torch.randn(48, 8, generator=g) * 0.3)
        down.set_slot(slot, 0, torch.randn(16, 48, generator=g) * 0.2, torch.randn(32, 16, generator=g))
    x, y = torch.randn(num_tokens, 40, generator=g), torch.randn(num_tokens, 96, generator=g)
    base_out = torch.randn(num_tokens, 32, generator=g)
    stream = torch.randn(num_tokens, 32, generator=g)
    token_slots = torch.tensor([(2, -1, 0, 1)[t % 4] for t in range(num_tokens)])
    batch.prepare(token_slots, token_slots.numpy())  # the CPU path: the delta into y
    act = gate_up.forward_silu_mul(x, lambda: y.clone(), lambda t: torch.nn.functional.silu(t[:, :48]) * t[:, 48:])
    want = down.forward(act, lambda: base_out.clone()) + stream
    for ahead in (False, True):
        batch.plan = plan_step(token_slots, 3, batch.shapes)
        out = gate_up.forward_silu_mul(x, lambda: y.clone(), None, then=down if ahead else None)
        assert (batch.ahead is not None) == (ahead and num_tokens <= triton_lora.ROWS_MAX_TOKENS)
        sink = stream.clone()
        got = down.forward(out, lambda: base_out.clone(), sink=sink)
        torch.testing.assert_close(got, base_out)  # y: the base output, untouched
        torch.testing.assert_close(got + sink, want, atol=1e-4, rtol=1e-4)
    # The default: the sink only where the LoRA runs beside the GEMM (a captured graph): else into y.
    monkeypatch.setattr(lora_layer, "SINK_MODE", "beside")
    batch.plan = plan_step(token_slots, 3, batch.shapes)
    out = gate_up.forward_silu_mul(x, lambda: y.clone(), None)
    sink = stream.clone()
    got = down.forward(out, lambda: base_out.clone(), sink=sink)
    assert torch.equal(sink, stream)
    torch.testing.assert_close(got + sink, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_add_kernel(dtype):
    """silu(gate + dg) * (up + du), the sums and the activation rounded as y + delta then
    `SiluAndMul` would be."""
    g = torch.Generator().manual_seed(31)
    y, d = torch.randn(7, 2 * 600, generator=g).to(dtype), (torch.randn(7, 2 * 600, generator=g) * 0.3).to(dtype)
    s = (y.float() + d.float()).to(dtype).float()
    gate, up = s.chunk(2, dim=1)
    want = (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype)
    got = triton_fused.silu_mul_add(y, d)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-3 if dtype == torch.float16 else 1e-5, rtol=1e-3)


@pytest.mark.parametrize("num_tokens", [5, 40])
def test_delta_beside_path_equals_cpu_path(num_tokens, monkeypatch):
    """`DELTA_BESIDE` (tile-kernel steps with a side stream): qkv's and gate_up's deltas written
    into a buffer of their own, then added to y (gate_up: then the activation) equal the CPU
    path's; steps of the per-token kernels keep their path."""
    monkeypatch.setattr(lora_layer, "DELTA_BESIDE", True)
    g = torch.Generator().manual_seed(29)
    batch = LoRABatch(torch.device("cpu"), 3)
    qkv = LoRASlots(batch, 3, 16, 40, [64, 32, 32], torch.float32, torch.device("cpu"))
    gate_up = LoRASlots(batch, 3, 16, 40, [48, 48], torch.float32, torch.device("cpu"))
    for slots in (qkv, gate_up):
        for slot in range(3):
            for part, size in enumerate(slots.part_starts[1:]):
                width = size - slots.part_starts[part]
                slots.set_slot(slot, part, torch.randn(8, 40, generator=g), torch.randn(width, 8, generator=g) * 0.3)
    x = torch.randn(num_tokens, 40, generator=g)
    y_qkv, y_gu = torch.randn(num_tokens, 128, generator=g), torch.randn(num_tokens, 96, generator=g)
    token_slots = torch.tensor([(2, -1, 0, 1)[t % 4] for t in range(num_tokens)])
    act = lambda t: torch.nn.functional.silu(t[:, :48]) * t[:, 48:]  # noqa: E731
    batch.prepare(token_slots, token_slots.numpy())  # the CPU path
    want_qkv, want_act = qkv.forward(x, lambda: y_qkv.clone()), gate_up.forward_silu_mul(x, lambda: y_gu.clone(), act)
    batch.plan = plan_step(token_slots, 3, batch.shapes)
    tiles = num_tokens > triton_lora.ROWS_MAX_TOKENS
    # (eager: the same kernels in stream order, no stream touched; the per-token path asks CUDA)
    batch.side_stream = object() if tiles else None
    assert qkv._delta_beside() == tiles
    torch.testing.assert_close(qkv.forward(x, lambda: y_qkv.clone()), want_qkv, atol=1e-4, rtol=1e-4)
    got = gate_up.forward_silu_mul(x, lambda: y_gu.clone(), act if tiles else None)
    torch.testing.assert_close(got, want_act, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("parts", [[48, 48], [64, 32, 32], [80]])
def test_dense_path_of_one_slot_steps(parts):
    """An eager step whose every token has one slot (`DENSE_MIN_TOKENS`: cuBLAS GEMMs on that
    slot's A and B; gate_up: the shrink a GEMM, the fused activation's kernel after) equals the CPU path."""
    g = torch.Generator().manual_seed(17)
    batch = LoRABatch(torch.device("cpu"), 3)
    slots = LoRASlots(batch, 3, 16, 40, parts, torch.float32, torch.device("cpu"))
    for slot in range(3):
        for part in range(len(parts)):
            slots.set_slot(slot, part, torch.randn(8, 40, generator=g), torch.randn(parts[part], 8, generator=g))
    x, y = torch.randn(40, 40, generator=g), torch.randn(40, sum(parts), generator=g)
    token_slots = torch.full((40,), 2)
    batch.prepare(token_slots, token_slots.numpy())  # the CPU path
    want = slots.forward(x, lambda: y.clone())
    batch.plan = plan_step(token_slots, 3, batch.shapes)
    batch.dense_slot = 2  # (what `prepare` decides on CUDA)
    torch.testing.assert_close(slots.forward(x, lambda: y.clone()), want, atol=1e-4, rtol=1e-4)
    if len(parts) == 2:
        act = slots.forward_silu_mul(x, lambda: y.clone(), None)
        torch.testing.assert_close(act, torch.nn.functional.silu(want[:, :48]) * want[:, 48:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("parts", [[48, 48], [64, 32, 32], [80]])
def test_dense_path_under_the_base_gemm(parts):
    """With the projection's weight known (unquantized, no bias), a one-slot eager step computes the
    delta first and the base GEMM on top of it (`_dense_under`): the base output plus the CPU
    path's deltas; gate_up then takes the plain activation. A base() that adds more than the
    layer's GEMM (plain=False) or a layer with a bias keeps the path that calls base()."""
    from tokenmill.layers.linear import Linear
    g = torch.Generator().manual_seed(23)
    batch = LoRABatch(torch.device("cpu"), 3)
    slots = LoRASlots(batch, 3, 16, 40, parts, torch.float32, torch.device("cpu"))
    for slot in range(3):
        for part in range(len(parts)):
            slots.set_slot(slot, part, torch.randn(8, 40, generator=g), torch.randn(parts[part], 8, generator=g))
    layer = Linear(40, sum(parts), bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(sum(parts), 40, generator=g) * 0.2)
    slots.layer = layer
    x = torch.randn(40, 40, generator=g)
    token_slots = torch.full((40,), 1)
    batch.prepare(token_slots, token_slots.numpy())  # the CPU path
    want = slots.forward(x, lambda: layer(x))
    batch.plan = plan_step(token_slots, 3, batch.shapes)
    batch.dense_slot = 1  # (what `prepare` decides on CUDA)
    calls = []

    def base():
        calls.append(1)
        return layer(x)
    torch.testing.assert_close(slots.forward(x, base), want, atol=1e-4, rtol=1e-4)
    assert not calls  # the GEMM ran under the delta, not through base()
    extra = torch.full((40, sum(parts)), 0.5)
    got = slots.forward(x, lambda: layer(x) + extra, plain=False)  # e.g. the residual inside the GEMM
    torch.testing.assert_close(got, want + extra, atol=1e-4, rtol=1e-4)
    if len(parts) == 2:
        act = slots.forward_silu_mul(x, base, lambda t: torch.nn.functional.silu(t[:, :48]) * t[:, 48:])
        torch.testing.assert_close(act, torch.nn.functional.silu(want[:, :48]) * want[:, 48:], atol=1e-4, rtol=1e-4)
        assert not calls
    layer.bias = torch.nn.Parameter(torch.randn(sum(parts), generator=g))
    torch.testing.assert_close(slots.forward(x, lambda: layer(x)), want + layer.bias.detach(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("knobs", [dict(SILU_TILE_BLOCK_N=128, EXPAND_TILE_BLOCK_N=256),
                                   dict(TILE_GRID_FACTOR=2.0, TILE_PROGRAMS_PER_SM=8, _TILES_MAX_SPLITS=32),
                                   dict(TILE_GRID_FACTOR=1.0, PLAN_KERNEL_MAX_TOKENS=0),
                                   dict(TILE_GRID_FACTOR=1.0), dict(TILE_ROWS_SMALL=64),
                                   dict(TILE_SPLITS_UNROLL=True),
                                   dict(SILU_TILE_BLOCK_N=256, _TILES_MAX_SPLITS=2, TILE_GRID_FACTOR=2.0,
                                        EXPAND_TILE_BLOCK_N=256)])
def test_tile_knobs_keep_results(monkeypatch, knobs):
    """The tile kernels' tunables (gpu_lora.py's layer variants: wider blocks, more programs per
    tile group and splits, the compact grid whose programs loop over several tiles, the torch
    plan) change the launch, not the result."""
    for name, value in knobs.items():
        monkeypatch.setattr(triton_lora, name, value)
    for num_tokens, parts in ((40, [512]), (600, [256, 256])):
        x, a, b, token_slots, y, starts = _case(num_tokens, parts, slots=5, k=300, seed=9)
        plan = plan_step(token_slots, a.shape[0], {(a.shape[1], 300)})
        planes = lora_shrink(x, a, plan)
        delta = lora_reference(x, a, b, starts, token_slots)
        if len(parts) == 2:
            gate, up = (y + delta).chunk(2, dim=1)
            torch.testing.assert_close(lora_expand_silu(planes, b, plan, y), torch.nn.functional.silu(gate) * up,
                                       atol=1e-4, rtol=1e-4)
        else:
            torch.testing.assert_close(lora_expand(planes, b, plan, y.clone(), starts), y + delta, atol=1e-4, rtol=1e-4)


# The one-slot path (`triton_concat`): [x | t] in one kernel. K = 300 at 20 and 40 tokens is split
# over programs (the last program of a row tile sums the slices); 600 tokens in tiles of 64 rows.
@pytest.mark.parametrize("num_tokens,k,parts", [(1, 40, 3), (20, 300, 3), (40, 300, 2), (600, 72, 1), (17, 520, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_concat_shrink_matches_reference(num_tokens, k, parts, dtype, monkeypatch):
    from tokenmill.layers.lora import triton_concat
    monkeypatch.setattr(triton_concat, "_sm_count", lambda device: 64)
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, k, generator=g).to(dtype)
    a = (torch.randn(4, parts * 16, k, generator=g) * 0.3).to(dtype)
    token_slots = torch.where(torch.rand(num_tokens, generator=g) < 0.3, -1, 2)  # one slot, and base tokens
    e = triton_concat.ext_columns(parts, 16)
    workspace = triton_concat.ConcatWorkspace(torch.device("cpu"))
    got = triton_concat.concat_shrink(x, a, token_slots, e, workspace)
    want = triton_concat.concat_shrink_reference(x, a, token_slots, e)
    assert got.shape == (num_tokens, k + e)
    assert torch.equal(got[:, :k], x)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got[:, k:].float(), want[:, k:].float(), rtol=tol, atol=tol)
    assert int(workspace.counters.abs().sum()) == 0  # every tile's counter back to zero (graph replays)


@pytest.mark.parametrize("with_bias", [False, True])
def test_concat_lora_inside_the_gemm_equals_base_plus_delta(with_bias):
    """`LoRASlots` with a wider weight: a one-slot step's output through the GEMM over [x | t]
    equals the base output (and its bias) plus the reference delta, for every part (qkv-like: 3 parts)."""
    from types import SimpleNamespace

    from tokenmill.layers.linear import UNQUANTIZED
    x, a, b, _, _, starts = _case(40, PARTS["qkv"], k=72)
    token_slots = torch.where(torch.arange(40) % 5 == 0, -1, 1)
    batch = LoRABatch(torch.device("cpu"), 3)
    slots = LoRASlots(batch, 3, 16, 72, PARTS["qkv"], torch.float32, torch.device("cpu"))
    slots.a.copy_(a)
    slots.b.copy_(b)
    weight = torch.randn(starts[-1], 72)
    bias = torch.randn(starts[-1]) if with_bias else None
    slots.layer = SimpleNamespace(weight=weight.clone(), bias=bias, quant_method=UNQUANTIZED)
    assert slots.attach_concat(cuda_only=False) and slots.layer.weight.stride(0) > 72
    batch.prepare(token_slots, token_slots.numpy())
    batch.plan = plan_step(token_slots, 3, batch.shapes)
    batch.decide_concat(token_slots, token_slots.numpy(), False)
    assert batch.concat and batch.concat_slot == 1
    got = slots.forward(x, lambda: pytest.fail("the base GEMM runs inside the concat GEMM"))
    want = x @ weight.t() + lora_reference(x, a, b, starts, token_slots) + (0 if bias is None else bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
