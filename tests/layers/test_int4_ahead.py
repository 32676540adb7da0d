"""INT4 dequantize-ahead (`quantization.int4_ahead`) on the CPU:
- its dequantization (the plain kernel's launch and the persistent programs) equals
  `triton_int4_mma.mma_dequantize` bit for bit under TRITON_INTERPRET=1;
- a plan over a few layers gives `mma_matmul`'s outputs bit for bit, step after step, and turns
  itself off (the plain path) when a call comes out of order;
- its stream protocol, recorded and replayed against a model of two CUDA streams with events in
  every interleaving a seeded scheduler tries: each GEMM reads its own layer's weight, no
  dequantization writes a slot while a GEMM reads it, every step ends joined. (The CUDA streams
  themselves run on a GPU only: `scripts/gpu_int4_ahead_check.py`.)"""

from __future__ import annotations

import os
import random

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch import nn

from tests.helpers.requirements import require_module
from tokenmill.layers.quantization import int4_packing as packing

require_module("triton")


def _layer(n: int, k: int, group: int, seed: int, dtype=torch.float32) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    codes = packing.quantize_int4(torch.randn(n, k, generator=g), group, sym=False)
    codes.scales = codes.scales.half().float()
    wt = packing.from_codes(codes, dtype, act_order=False)
    layer = nn.Module()
    layer.qweight, layer.scales, layer.zeros = packing.to_mma(wt.qweight), wt.scales, wt.zeros
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,group,ctas", [(64, 256, 64, 0), (64, 256, 64, 1), (32, 128, 64, 3), (48, 192, 64, 2)])
def test_dequantize_into_equals_mma_dequantize(n, k, group, ctas, dtype):
    from tokenmill.layers.quantization.int4_ahead import dequantize_into
    from tokenmill.layers.quantization.triton_int4_mma import mma_dequantize

    layer = _layer(n, k, group, seed=n + k, dtype=dtype)
    ref = mma_dequantize(layer.qweight, layer.scales, layer.zeros, group, dtype)  # [K, N] view of [N, K]
    out = torch.full((n, k), float("nan"), dtype=dtype)
    dequantize_into(out, layer.qweight, layer.scales, layer.zeros, group, ctas)
    assert torch.equal(out, ref.t())


class ImmediateSync:
    """One stream: everything runs as it is queued."""

    def __init__(self) -> None:
        self.joins = 0

    def fork(self): pass
    def on_side(self, fn): fn()
    def side_waits_freed(self, slot): pass
    def side_records_ready(self, slot): pass
    def main_waits_ready(self, slot): pass
    def main_records_freed(self, slot): pass

    def join(self):
        self.joins += 1


def _plan(units, group, dtype, sync, ahead, dequant=None):
    from tokenmill.layers.quantization.int4_ahead import AheadPlan

    numel = max(u.qweight.shape[0] * 16 * u.qweight.shape[1] * 64 for u in units)
    ring = [torch.empty(numel, dtype=dtype) for _ in range(ahead + 1)]
    return AheadPlan(units, group, dtype, sync, ahead, ring, dequant)


SHAPES = [(64, 128), (32, 64 * 2), (128, 64), (64, 128)] * 2  # (n, k) of the units in call order


def _own(u, group):
    from tokenmill.layers.quantization.triton_int4_mma import mma_matmul

    return lambda x: mma_matmul(x, u.qweight, u.scales, u.zeros, group)


@pytest.mark.parametrize("ahead,lead", [(1, 1), (2, 1), (1, 3), (2, 2)])
def test_plan_equals_mma_matmul_bit_for_bit(ahead, lead, monkeypatch):
    from tokenmill.layers.quantization import int4_ahead

    group, dtype, m = 64, torch.float16, 40
    units = [_layer(n, k, group, seed=i, dtype=dtype) for i, (n, k) in enumerate(SHAPES)]
    assert all(int4_ahead.dequant_route(m, n, k, group, dtype) for n, k in SHAPES)
    assert not int4_ahead.dequant_route(8, 64, 128, group, dtype)  # the GEMV's rows: never a unit
    if lead > 1:  # linears of 32 outputs take "another path" (their own): the units' dequantizations lead them
        real = int4_ahead.dequant_route
        monkeypatch.setattr(int4_ahead, "dequant_route", lambda m, n, k, g, dt: n != 32 and real(m, n, k, g, dt))
    sync = ImmediateSync()
    plan = _plan(units, group, dtype, sync, ahead)
    plan.lead = lead
    ring_gemms = []
    plan.gemm = lambda x, w: ring_gemms.append(1) or torch.matmul(x, w)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        for u, (n, k) in zip(units, SHAPES):
            x = torch.randn(m, k, generator=g).to(dtype)
            out = plan.run(u, x, _own(u, group))
            assert torch.equal(out, _own(u, group)(x)), (step, n, k)
        assert sync.joins == step + 1  # each step ends joined
    assert len(ring_gemms) == 2 * sum(n != 32 or lead == 1 for n, _ in SHAPES)
    mark = torch.zeros(1)
    assert plan.run(units[0], torch.zeros(8, 128, dtype=dtype), lambda x: mark) is mark  # 8 rows: not a unit
    assert plan.run(units[0], torch.zeros(m, 128), lambda x: mark) is mark  # another dtype


def test_plan_turns_off_on_a_call_out_of_order(caplog):
    group, dtype, m = 64, torch.float16, 40
    units = [_layer(n, k, group, seed=i, dtype=dtype) for i, (n, k) in enumerate(SHAPES)]
    sync = ImmediateSync()
    plan = _plan(units, group, dtype, sync, 1)
    mark = torch.zeros(1)
    assert plan.run(units[0], torch.zeros(m, 128, dtype=dtype), lambda x: mark) is not mark
    assert plan.run(units[1], torch.zeros(m + 24, 128, dtype=dtype), lambda x: mark) is mark  # another row count
    assert plan.enabled
    with caplog.at_level("WARNING"):
        assert plan.run(units[2], torch.zeros(m, 64, dtype=dtype), lambda x: mark) is mark  # unit 1 skipped
    assert not plan.enabled and "dequantize-ahead off" in caplog.text and sync.joins == 1
    assert plan.run(units[0], torch.zeros(m, 128, dtype=dtype), lambda x: mark) is mark  # off for good


# ------------------------------------------------------------------ the stream protocol

class RecordingSync:
    """Logs what `AheadPlan` queues on which stream; waits resolve (as CUDA's do) to the event's
    latest record queued before them, or to nothing."""

    def __init__(self, skip_freed: bool = False) -> None:
        self.ops: dict[str, list] = {"main": [], "side": []}
        self.last: dict = {}  # event -> (stream, index) of its latest record
        self.skip_freed = skip_freed  # a broken plan: the side stream ignores `freed`

    def _wait(self, stream, event):
        self.ops[stream].append(("wait", self.last.get(event)))

    def _record(self, stream, event):
        self.last[event] = (stream, len(self.ops[stream]))
        self.ops[stream].append(("record",))

    def fork(self):
        self.ops["side"].append(("wait", ("main", len(self.ops["main"]) - 1) if self.ops["main"] else None))

    def on_side(self, fn):
        fn()  # the dequant callable appends its kernel to the side stream

    def side_waits_freed(self, slot):
        if not self.skip_freed:
            self._wait("side", ("freed", slot))

    def side_records_ready(self, slot):
        self._record("side", ("ready", slot))

    def main_waits_ready(self, slot):
        self._wait("main", ("ready", slot))

    def main_records_freed(self, slot):
        self._record("main", ("freed", slot))

    def join(self):
        self.ops["main"].append(("wait", ("side", len(self.ops["side"]) - 1) if self.ops["side"] else None))


def _replay(ops: dict, rng: random.Random | None, side_first: bool) -> None:
    """Runs both streams in one interleaving. A kernel is a begin and an end (other work may run
    between); a stream's next op waits for its previous one's end and, for a wait, for the
    record it names. Asserts the hazards."""
    done = {"main": 0, "side": 0}  # ops completed per stream
    running: dict[str, tuple] = {}  # stream -> kernel begun, not ended
    slots: dict[int, int] = {}  # slot -> unit whose weight it holds
    readers: dict[int, int] = {}
    writers: dict[int, int] = {}

    def ready(s: str) -> bool:
        if s in running:
            return True  # its kernel can end
        if done[s] == len(ops[s]):
            return False
        op = ops[s][done[s]]
        return op[0] != "wait" or op[1] is None or done[op[1][0]] > op[1][1]

    while True:
        choices = [s for s in ("side", "main") if ready(s)]
        if not choices:
            break
        s = rng.choice(choices) if rng else choices[0 if side_first else -1]
        if s in running:  # the kernel ends
            kind, unit, slot = running.pop(s)
            if kind == "gemm":
                assert slots.get(slot) == unit and not writers.get(slot), f"GEMM of unit {unit} read slot {slot}"
                readers[slot] -= 1
            else:
                writers[slot] -= 1
                slots[slot] = unit
            done[s] += 1
            continue
        op = ops[s][done[s]]
        if op[0] in ("gemm", "dequant"):
            _, unit, slot = op
            if op[0] == "gemm":
                assert slots.get(slot) == unit and not writers.get(slot), f"GEMM of unit {unit} began on slot {slot}"
                readers[slot] = readers.get(slot, 0) + 1
            else:
                assert not readers.get(slot) and not writers.get(slot), f"slot {slot} written while in use"
                writers[slot] = writers.get(slot, 0) + 1
                slots.pop(slot, None)
            running[s] = op
        else:
            done[s] += 1
    assert done["main"] == len(ops["main"]) and done["side"] == len(ops["side"]), "a stream never finished"
    last_side = len(ops["side"]) - 1
    assert any(op[0] == "wait" and op[1] == ("side", last_side) for op in ops["main"]), "the side stream never joined"


def _record_steps(ahead: int, steps: int, lead: int = 1, skip_freed: bool = False, monkeypatch=None,
                  anchors: frozenset[int] = frozenset()) -> dict:
    from tokenmill.layers.quantization import int4_ahead

    group, dtype, m = 64, torch.float16, 40
    units = [_layer(n, k, group, seed=i, dtype=dtype) for i, (n, k) in enumerate(SHAPES)]
    if monkeypatch is not None:  # linears of 32 outputs take their own path: non-units between the units
        monkeypatch.setattr(int4_ahead, "dequant_route", lambda m, n, k, g, dt: n != 32)
    sync = RecordingSync(skip_freed)
    index = {id(u): i for i, u in enumerate(units)}
    plan = _plan(units, group, dtype, sync, ahead)
    plan.lead, plan.anchors = lead, anchors
    ring_ptr = {t.data_ptr(): i for i, t in enumerate(plan.ring)}

    def dequant(out, u):
        sync.ops["side"].append(("dequant", index[id(u)], ring_ptr[out.data_ptr()]))
        return out

    plan.dequant = dequant
    current = {}

    def gemm(x, w):  # (the plan's x @ W^T: logged with the unit it serves)
        sync.ops["main"].append(("gemm", current["unit"], ring_ptr[w.data_ptr()]))
        return torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype)

    def own(x):
        sync.ops["main"].append(("other",))  # a linear's own kernel
        return x

    plan.gemm = gemm
    for _ in range(steps):
        for i, (u, (n, k)) in enumerate(zip(units, SHAPES)):
            current["unit"] = i
            sync.ops["main"].append(("other",))  # the step's other kernels between its GEMMs
            plan.run(u, torch.zeros(m, k, dtype=dtype), own)
    return sync.ops


@pytest.mark.parametrize("ahead,lead,others,anchors", [(1, 1, False, ()), (2, 1, False, ()), (3, 1, False, ()),
                                                        (1, 3, True, ()), (2, 2, True, ()), (1, 1, True, ()),
                                                        (1, 1, True, (1, 5)), (2, 1, True, (0, 5))])
def test_stream_protocol_has_no_hazard_in_any_interleaving(ahead, lead, others, anchors, monkeypatch):
    ops = _record_steps(ahead, steps=2, lead=lead, monkeypatch=monkeypatch if others else None,
                        anchors=frozenset(anchors))
    units = sum(n != 32 or not others for n, _ in SHAPES)
    assert sum(op[0] == "dequant" for op in ops["side"]) == 2 * units
    _replay(ops, None, side_first=True)
    _replay(ops, None, side_first=False)
    for seed in range(200):
        _replay(ops, random.Random(seed), side_first=False)


def test_stream_protocol_check_catches_a_missing_wait():
    ops = _record_steps(1, steps=2, skip_freed=True)  # the protocol broken on purpose
    with pytest.raises(AssertionError):
        _replay(ops, None, side_first=True)


def test_issue_points_lead_the_units_and_wait_for_their_slot():
    from tokenmill.layers.quantization.int4_ahead import _Step

    mods = [nn.Module() for _ in range(8)]  # full order 0..7; 1 and 5 take their own path
    seq = [mods[i] for i in (0, 2, 3, 4, 6, 7)]
    full = {id(u): i for i, u in enumerate(mods)}
    # two slots, three calls ahead: unit j after linear max(own - 3, its slot's last reader, the first unit)
    assert _Step(seq, full, slots=2, lead=3).upto == {0: 3, 1: 3, 2: 4, 3: 5, 4: 6, 5: 6, 6: 6, 7: 6}
    # one call ahead: each unit after the linear before it
    assert _Step(seq, full, slots=2, lead=1).upto == {0: 1, 1: 2, 2: 3, 3: 4, 4: 4, 5: 5, 6: 6, 7: 6}


def test_anchors_move_the_issue_points_where_other_linears_run_between_units():
    from tokenmill.layers.quantization.int4_ahead import _Step, anchors_of

    names = [f"layers.{i // 4}.{p}" for i in range(12) for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")][:12]
    anchors = anchors_of(names, "gate_up_proj")
    assert anchors == {2, 6, 10} and anchors_of(names, "") == frozenset()
    mods = [nn.Module() for _ in range(12)]
    full = {id(u): i for i, u in enumerate(mods)}
    o_only = [mods[i] for i in (1, 5, 9)]  # decode: o_proj the units, the rest swapped GEMMs
    # o of layer 1 after layer 0's gate_up (index 2), o of layer 2 after layer 1's (6)
    assert _Step(o_only, full, slots=2, lead=1, anchors=anchors).upto == {
        1: 1, 2: 2, 3: 2, 4: 2, 5: 2, 6: 3, 7: 3, 8: 3, 9: 3}
    assert _Step(o_only, full, slots=2, lead=1).upto[4] == 2 and _Step(o_only, full, slots=2, lead=1).upto[3] == 1
    every = [mods[i] for i in range(8)]  # prefill: every linear a unit; anchors change nothing
    assert _Step(every, full, 2, 1, anchors).upto == _Step(every, full, 2, 1).upto


def test_steps_below_min_rows_take_their_own_path():
    group, dtype, m = 64, torch.float16, 40
    units = [_layer(n, k, group, seed=i, dtype=dtype) for i, (n, k) in enumerate(SHAPES)]
    plan = _plan(units, group, dtype, ImmediateSync(), 1)
    plan.min_rows = m + 1
    mark = torch.zeros(1)
    assert all(plan.run(u, torch.zeros(m, k, dtype=dtype), lambda x: mark) is mark for u, (_, k) in zip(units, SHAPES))
    assert plan.run(units[0], torch.zeros(m + 1, 128, dtype=dtype), lambda x: mark) is not mark
