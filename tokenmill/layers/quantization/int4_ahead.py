"""INT4 dequantize-ahead (issue 22): where a step's INT4 linears take dequantize + cuBLAS (the last
path of `triton_int4_mma.mma_matmul`: prefill chunks, o_proj at 256 rows), the next such linear's
weight is dequantized on a side stream into a ring of buffers while the current one's GEMM runs,
instead of in front of its own GEMM on the compute stream. The same kernel's values and the same
cuBLAS call (x @ W^T, W [N, K] contiguous): bit for bit the unoverlapped path's output.

Order: a model's INT4 linears in the mma layout, in module order, are the order a step calls them
(the Llama family's qkv, o, gate_up, down by layer). A step's *units* are those that take the
dequantizing path at its row count (`dequant_route`); the call of the first one begins a step. A
call out of that order joins the side stream, turns the plan off and logs it: the plain path then.

Hazards, `AHEAD` = L units ahead and L + 1 ring slots (unit j in slot j % (L + 1)):
- unit j's GEMM waits on the compute stream for `ready[j]`, recorded on the side stream after its
  dequantization;
- unit j + L + 1's dequantization (the next occupant of j's slot) waits on the side stream for
  `freed[j]`, recorded on the compute stream after unit j's GEMM, and is queued no earlier (host
  order: the wait names that record);
- a unit's dequantization is queued after the launch of the linear `LEAD` calls before it (or an
  anchor's, `AT`), so that the GEMMs queued first get their CTAs dispatched first and the
  dequantization fills what they leave;
- a step begins with the side stream waiting for the compute stream (fork) and ends with the
  compute stream waiting for the last dequantization (join): CUDA graphs capture it as branches.
`Sync` is that protocol's interface: CUDA streams and events (`CudaSync`), or a recorder that the
CPU tests replay against a two-stream model (`tests/layers/test_int4_ahead.py`).

Memory: L + 1 buffers of the largest unit's weight in the activation dtype (Llama-8B: gate_up,
117M values, 235 MB each), allocated at load (`attach`: before the KV pool is sized) and logged.

TOKENMILL_INT4_AHEAD: units ahead (default 0: off; 2: the settings measured). TOKENMILL_INT4_AHEAD_CTAS:
the side stream's dequantization as that many persistent programs (default 0: one program a block,
the compute stream's launch). TOKENMILL_INT4_AHEAD_PRIORITY: the side stream's priority (default 0,
the compute stream's; -1: higher). TOKENMILL_INT4_AHEAD_LEAD: linear calls ahead of its unit that a
dequantization is queued (default 2). TOKENMILL_INT4_AHEAD_AT: where other linears run between a
step's units (decode: o_proj's dequantization between the swapped GEMMs), queue each unit's after
the latest linear before it whose module name ends so (e.g. "gate_up_proj": beside that GEMM).
TOKENMILL_INT4_AHEAD_MIN_ROWS: steps of fewer rows never use the ring (default 1025: prefill chunks).
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

import torch
import triton
import triton.language as tl
from torch import nn

logger = logging.getLogger(__name__)

# Off by default: on H200s the ring hid ~30% of a prefill chunk's dequantization in isolation but
# gained nothing end to end (docs/results/gpu-int4-gemm.md, session 10); 2: the measured settings.
AHEAD = int(os.environ.get("TOKENMILL_INT4_AHEAD", "0"))
LEAD = int(os.environ.get("TOKENMILL_INT4_AHEAD_LEAD", "2"))
AT = os.environ.get("TOKENMILL_INT4_AHEAD_AT", "")
CTAS = int(os.environ.get("TOKENMILL_INT4_AHEAD_CTAS", "0"))
PRIORITY = int(os.environ.get("TOKENMILL_INT4_AHEAD_PRIORITY", "0"))
# Steps of fewer rows take the plain path: decode graphs' o_proj lost with the ring on an H200 (its
# cuBLAS then reads the weight from HBM, not from L2 behind its dequantization, and the branches
# cost), so by default prefill chunks only (above the GEMM tables' largest bucket, 1024).
MIN_ROWS = int(os.environ.get("TOKENMILL_INT4_AHEAD_MIN_ROWS", "1025"))


def dequant_route(m: int, n: int, k: int, group: int, dtype: torch.dtype) -> bool:
    """Whether `triton_int4_mma.mma_matmul` takes [m, k] x [k, n] by dequantize + cuBLAS (x in its
    natural order: a producer writes it permuted only for the swapped GEMM, `int4_kperm`)."""
    from tokenmill.layers.quantization import triton_int4_dot_gemm as dot
    from tokenmill.layers.quantization import triton_int4_mma as mma
    from tokenmill.layers.quantization import triton_int4_mma_gemm as gemm

    if m <= mma.ROWS or m <= mma.LOOP_MAX_ROWS:
        return False
    return dot.dot_tiles(m, n, k, group, dtype) is None and gemm.gemm_tiles(m, n, k, group) is None


@triton.jit
def _ahead_dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, K, s_sg, s_on, nblocks, GROUP: tl.constexpr,
                          ROWS: tl.constexpr):
    """`triton_int4_mma._mma_dequant_kernel` as persistent programs: program p takes row blocks p,
    p + grid, ... (the same values; few CTAs, so that it can run beside a GEMM)."""
    for blk in range(tl.program_id(0), nblocks, tl.num_programs(0)):
        rows = blk * ROWS + tl.arange(0, ROWS)
        words = tl.load(w_ptr + rows.to(tl.int64)[:, None] * 4 + tl.arange(0, 4)[None, :])  # [ROWS, 4 (m)]
        steps = K // 64
        lane = rows % 32
        n0 = (rows // (steps * 32)) * 16 + lane // 4
        k0 = ((rows // 32) % steps) * 64 + (lane % 4) * 16
        grp = (k0 // GROUP).to(tl.int64) * s_sg
        off = tl.arange(0, 4)  # a word's input offset: nibble 2 (off // 2) + 4 (off % 2)
        shift = 8 * (off // 2) + 16 * (off % 2)
        cols = k0[:, None] + tl.arange(0, 16)[None, :]
        for hi in tl.static_range(2):  # channel g + 8 hi: nibbles one up
            q = ((words[:, :, None] >> (shift + 4 * hi)[None, None, :]) & 0xF).to(tl.float32)
            q = tl.reshape(q, (ROWS, 16))
            n = n0 + 8 * hi
            sc = tl.load(s_ptr + grp + n).to(tl.float32)
            z = tl.load(z_ptr + grp + n).to(tl.float32)
            tl.store(out_ptr + n.to(tl.int64)[:, None] * s_on + cols,
                     ((q - z[:, None]) * sc[:, None]).to(out_ptr.dtype.element_ty))


def dequantize_into(out: torch.Tensor, qm: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, ctas: int = 0) -> torch.Tensor:
    """W [N, K] of the mma layout into `out` (contiguous [N, K]): `mma_dequantize`'s values (its
    kernel and launch where ctas is 0; else `_ahead_dequant_kernel` on `ctas` programs)."""
    from tokenmill.layers.quantization.triton_int4_mma import _mma_dequant_kernel

    n, k = qm.shape[0] * 16, qm.shape[1] * 64
    group = k if group_size == -1 else group_size
    rows = n * k // 32
    block = 256 if rows % 256 == 0 else 32
    if ctas <= 0:
        _mma_dequant_kernel[(rows // block,)](qm, scales, zeros, out, k, scales.stride(0), out.stride(0), GROUP=group,
                                              ROWS=block, num_warps=4)
    else:
        _ahead_dequant_kernel[(min(ctas, rows // block),)](qm, scales, zeros, out, k, scales.stride(0), out.stride(0),
                                                           rows // block, GROUP=group, ROWS=block, num_warps=4)
    return out


class Sync(Protocol):
    """The two streams' ordering (see the module docstring). Slots index `ready` / `freed` events."""

    def fork(self) -> None: ...  # the side stream waits for the compute stream's work so far
    def on_side(self, fn) -> None: ...  # fn() queued on the side stream
    def side_waits_freed(self, slot: int) -> None: ...
    def side_records_ready(self, slot: int) -> None: ...
    def main_waits_ready(self, slot: int) -> None: ...
    def main_records_freed(self, slot: int) -> None: ...
    def join(self) -> None: ...  # the compute stream waits for everything on the side stream


class CudaSync:
    def __init__(self, device: torch.device, slots: int, priority: int = 0) -> None:
        self.side = torch.cuda.Stream(device, priority=priority)
        self.ready = [torch.cuda.Event() for _ in range(slots)]
        self.freed = [torch.cuda.Event() for _ in range(slots)]

    def fork(self) -> None:
        self.side.wait_stream(torch.cuda.current_stream())

    def on_side(self, fn) -> None:
        with torch.cuda.stream(self.side):
            fn()

    def side_waits_freed(self, slot: int) -> None:
        self.side.wait_event(self.freed[slot])

    def side_records_ready(self, slot: int) -> None:
        self.ready[slot].record(self.side)

    def main_waits_ready(self, slot: int) -> None:
        torch.cuda.current_stream().wait_event(self.ready[slot])

    def main_records_freed(self, slot: int) -> None:
        self.freed[slot].record(torch.cuda.current_stream())

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.side)


class _Step:
    """A row count's units (`seq`, position by id) and when each is dequantized: after the launch of
    the linear at full-order index i, units up to `upto[i]` (exclusive) have been queued."""

    def __init__(self, seq: list[nn.Module], full: dict[int, int], slots: int, lead: int,
                 anchors: frozenset[int] = frozenset()) -> None:
        self.seq = seq
        self.pos = {id(u): j for j, u in enumerate(seq)}
        fi = [full[id(u)] for u in seq]
        # unit j: `lead` linear calls before its own, or where other linears run between the units
        # and an anchor (`AheadPlan.anchors`) precedes it, after the latest one; never before its slot's
        # last reader's GEMM (whose `freed` record its wait must follow), nor before the step's first
        # unit (the fork)
        between = bool(seq) and fi[-1] - fi[0] + 1 > len(seq)
        points = []
        for j in range(len(seq)):
            at = max((a for a in anchors if fi[0] <= a < fi[j]), default=None) if between else None
            points.append(max(fi[j] - lead if at is None else at, fi[j - slots] if j >= slots else -1, fi[0]))
        self.upto = {i: sum(p <= i for p in points) for i in range(fi[0], fi[-1] + 1)} if seq else {}


class AheadPlan:
    """One model's INT4 linears (`units`, call order), the ring and the step in progress."""

    def __init__(self, units: list[nn.Module], group_size: int, dtype: torch.dtype, sync: Sync, ahead: int,
                 ring: list[torch.Tensor], dequant=None, ctas: int = 0, lead: int = 1,
                 anchors: frozenset[int] = frozenset(), min_rows: int = 0) -> None:
        self.min_rows = min_rows  # steps of fewer rows: no units
        self.units, self.group_size, self.dtype = units, group_size, dtype
        self.sync, self.ahead, self.ring, self.ctas, self.lead = sync, ahead, ring, ctas, max(1, lead)
        # (out, layer) -> out: W [N, K] of the layer into out (tests: any writer)
        self.dequant = dequant or (lambda out, u: dequantize_into(out, u.qweight, u.scales, u.zeros, self._group(u),
                                                                  self.ctas))
        self.gemm = torch.matmul  # (x, W^T) -> x @ W^T: `mma_matmul`'s own call (tests: a recorder)
        self.enabled = True
        self._full = {id(u): i for i, u in enumerate(units)}
        self.anchors = anchors  # full-order indices of linears that units' dequantizations follow (`_Step`)
        self._steps: dict[int, _Step] = {}  # rows -> its units
        self._cur: _Step | None = None  # the step in progress
        self._pos = 0  # its next unit
        self._issued = 0  # its units queued on the side stream

    @staticmethod
    def shape(layer: nn.Module) -> tuple[int, int]:
        q = layer.qweight
        return q.shape[0] * 16, q.shape[1] * 64

    def _step(self, m: int) -> _Step:
        if m not in self._steps:
            seq = [u for u in self.units
                   if m >= self.min_rows and dequant_route(m, *self.shape(u), self._group(u), self.dtype)]
            self._steps[m] = _Step(seq if len(seq) >= 2 else [], self._full, len(self.ring), self.lead,
                                   self.anchors)
        return self._steps[m]

    def _group(self, layer: nn.Module) -> int:
        return self.shape(layer)[1] if self.group_size == -1 else self.group_size

    def _issue_upto(self, count: int) -> None:
        """The step's units up to `count` (exclusive) queued: each one's dequantization into its slot on
        the side stream, after its slot's last reader."""
        while self._issued < count:
            j = self._issued
            slot = j % len(self.ring)
            if j >= len(self.ring):
                self.sync.side_waits_freed(slot)
            u = self._cur.seq[j]
            n, k = self.shape(u)
            buf = self.ring[slot][:n * k].view(n, k)
            self.sync.on_side(lambda buf=buf, u=u: self.dequant(buf, u))
            self.sync.side_records_ready(slot)
            self._issued += 1

    def run(self, layer: nn.Module, x: torch.Tensor, own, kperm: bool = False) -> torch.Tensor:
        """x [M, K] @ W^T: through the ring where `layer` is this step's next unit, else `own(x)` (the
        layer's own path); then the dequantizations due after this linear are queued. kperm: x in the
        swapped GEMM's K order (`int4_kperm`), put back for the ring's GEMM."""
        if not self.enabled or x.dtype != self.dtype:
            return own(x)
        step = self._step(x.shape[0])
        j = step.pos.get(id(layer))
        if j == 0:  # a step begins (one left unfinished: its side work joined first)
            if self._cur is not None and self._pos < len(self._cur.seq):
                self.sync.join()
            self._cur, self._pos, self._issued = step, 0, 0
            self.sync.fork()
        elif step is not self._cur or self._pos in (0, len(step.seq)):  # no step of these rows in progress
            return own(x)
        elif j is not None and j != self._pos:
            self._off(f"{type(layer).__name__} at {x.shape[0]} rows called as unit {j}, expected unit "
                      f"{self._pos} of {len(step.seq)}")
            return own(x)
        if j is None:
            out = own(x)
        else:
            self._issue_upto(j + 1)  # (its own, where no earlier call queued it)
            slot = j % len(self.ring)
            n, k = self.shape(layer)
            self.sync.main_waits_ready(slot)
            if kperm:
                from tokenmill.layers.quantization.int4_kperm import unpermute

                x = unpermute(x)
            out = self.gemm(x, self.ring[slot][:n * k].view(n, k).t())
            self.sync.main_records_freed(slot)
            self._pos = j + 1
        self._issue_upto(step.upto.get(self._full[id(layer)], self._issued))
        if self._pos == len(step.seq):
            self.sync.join()  # (already ordered by the last ready; explicit for graph captures)
        return out

    def _off(self, why: str) -> None:
        self.sync.join()
        self.enabled = False
        self._cur = None
        logger.warning("int4 dequantize-ahead off: %s (the plain dequantize + cuBLAS from now on)", why)


def _int4_units(model: nn.Module) -> tuple[list[nn.Module], list[str]]:
    from tokenmill.layers.quantization.int4 import Int4LinearMethod

    out, names = [], []
    for name, module in model.named_modules():
        q = getattr(module, "qweight", None)
        if (isinstance(getattr(module, "quant_method", None), Int4LinearMethod) and q is not None and q.dim() == 4
                and q.is_cuda and getattr(module, "g_idx", None) is None):
            out.append(module)
            names.append(name)
    return out, names


def anchors_of(names: list[str], suffixes: str) -> frozenset[int]:
    """Indices of the names ending in one of the comma-separated suffixes (TOKENMILL_INT4_AHEAD_AT)."""
    ends = tuple(filter(None, (p.strip() for p in suffixes.split(","))))
    return frozenset(i for i, n in enumerate(names) if ends and n.endswith(ends))


def attach(model: nn.Module) -> int:
    """On CUDA, with TOKENMILL_INT4_AHEAD > 0 and two INT4 linears or more in the mma layout: the
    plan, its ring allocated now, set on each unit as `int4_ahead` (read by `Int4LinearMethod`).
    Returns the ring's bytes (0: none)."""
    units, names = _int4_units(model)
    if AHEAD <= 0 or len(units) < 2:
        return 0
    method = units[0].quant_method
    dtype, group = method.act_dtype, method.config.group_size
    if dtype not in (torch.bfloat16, torch.float16) or any(u.quant_method.config.group_size != group for u in units):
        return 0
    numel = max(AheadPlan.shape(u)[0] * AheadPlan.shape(u)[1] for u in units)
    device = units[0].qweight.device
    slots = AHEAD + 1
    ring = [torch.empty(numel, dtype=dtype, device=device) for _ in range(slots)]
    ctas = CTAS
    plan = AheadPlan(units, group, dtype, CudaSync(device, slots, PRIORITY), AHEAD, ring, ctas=ctas, lead=LEAD,
                     anchors=anchors_of(names, AT), min_rows=MIN_ROWS)
    for u in units:
        u.int4_ahead = plan
    nbytes = slots * numel * ring[0].element_size()
    logger.info("int4: dequantize-ahead for %d linears: %d buffers of %d values, %.2f GiB (in the model's peak "
                "memory; TOKENMILL_INT4_AHEAD=%d units ahead, 0: off; %s)", len(units), slots, numel, nbytes / 2**30,
                AHEAD, f"{ctas} persistent programs" if ctas > 0 else "one program a block")
    return nbytes
