"""A projection's LoRA slots and the step's token -> slot map, and the hook the model calls.

A projection with LoRA slots attached (`layer.lora`) binds them into its forward once
(`linear.with_lora`, `Linear.rebind`): `LoRASlots.forward(x, base)`, `base()` computing the layer's
output y for input x (before any tensor-parallel reduction), adds the step's per-token adapter
deltas into y in place; a step without adapter tokens (`LoRABatch.active` False) skips it. The base layer's code (its linear method) is untouched: LoRA is
a sum on its output. While a CUDA graph is captured, the shrink (which reads x only) runs on a
side stream beside the base GEMM, so a replay overlaps them and only the expand follows the GEMM.

`sink` (o_proj, down_proj of one TP rank's whole sum): the float32 residual stream the output is
added to next. The delta then goes into the sink instead of y, so the whole LoRA (shrink and
expand) runs beside the base GEMM on the side stream, off the step's critical path; y is the
base output untouched.

One slot a step (`LoRABatch.concat`; qkv and gate_up, whose weights `attach_concat` moved into
wider buffers): the LoRA runs inside the GEMM itself, [x | t] against [W | B] (`triton_concat`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

from tokenmill.layers import triton_ops
from tokenmill.layers.lora.torch_lora import lora_add_grouped, lora_reference


# Captured steps of more tokens run the shrink in stream order (no side stream): on an H200 (32
# layers' GEMMs + LoRA in one graph) the side stream saved 5.6 us a layer at 1 token, 16-24 at 64;
# at 256 it cost 2-3 with the deltas into y, and saved 2 with o's / down's going into the stream.
OVERLAP_MAX_TOKENS = 256
# Captured steps of up to this many tokens run a sink projection's whole LoRA beside its GEMM (H200,
# per layer: 5.5 us saved at 1 token, 4-5 at 256 tokens of 1 or 8 adapters, nothing at 64 adapters;
# at 8192 tokens it cost 150-200).
SINK_OVERLAP_MAX_TOKENS = int(os.environ.get("TOKENMILL_LORA_SINK_OVERLAP_MAX", "256"))
# Eager steps (prefill chunks) of at least this many tokens run it beside the GEMM too (the host's
# cost of the stream switches is nothing next to such a step's GPU time); default: never.
SINK_EAGER_MIN_TOKENS = int(os.environ.get("TOKENMILL_LORA_SINK_EAGER_MIN", str(1 << 30)))
# Where o_proj's / down_proj's deltas go into the residual stream the model offers (the sink):
# "beside": in steps of up to SINK_OVERLAP_MAX_TOKENS with a side stream, where captured their
# LoRA runs beside the GEMM (eager, as the warm-up before a capture, in stream order: the same
# kernels compile); larger steps add into y (the float32 stream costs twice y's bytes to update,
# which counts at prefill sizes); "always"; "never".
SINK_MODE = os.environ.get("TOKENMILL_LORA_SINK", "beside")
# Eager steps of at least this many tokens, every one of one adapter (known on the host: a
# 1-adapter workload's prefill chunks), run the shrink (and the expand but gate_up's) as cuBLAS
# GEMMs on that slot's A and B instead of the tile kernels (H200, 8192 tokens: 6293 vs 6394 us a
# layer, the same graph on the tiles; the run-to-run spread there is about 100).
DENSE_MIN_TOKENS = int(os.environ.get("TOKENMILL_LORA_DENSE_MIN", "1024"))
# Those dense steps compute each projection's delta first (cuBLAS: the shrink, then one GEMM per
# part writing the delta) and then the base GEMM on top of it (addmm, beta = 1: the delta is read
# in the GEMM's epilogue, no pass over y of its own; gate_up then takes the plain activation),
# where the layer's base output is a plain GEMM of its weight (unquantized, no bias). 0: the
# delta added into the base's y afterwards.
DENSE_FUSED = os.environ.get("TOKENMILL_LORA_DENSE_FUSED", "1") not in ("0", "false", "no")
# ... gate_up too (0: its shrink a GEMM, then the expand fused with the activation, which reads
# y once: no delta written and read back, but the tile kernel's own cost).
DENSE_FUSED_SILU = os.environ.get("TOKENMILL_LORA_DENSE_FUSED_SILU", "1") not in ("0", "false", "no")
# Steps of the tile kernels (more than ROWS_MAX_TOKENS tokens) up to OVERLAP_MAX_TOKENS: qkv's and
# gate_up's whole LoRA (shrink and expand) beside their GEMM when captured, the expand writing the
# delta into a buffer of its own, then one add into y (gate_up: the activation reading both): an
# elementwise pass on the critical path instead of the expand kernel (eager: the same kernels in
# stream order, as the warm-up before a capture compiles them). 0: only the shrink beside.
DELTA_BESIDE = os.environ.get("TOKENMILL_LORA_DELTA_BESIDE", "1") not in ("0", "false", "no")
# gate_up's fused expand + activation also does down_proj's shrink at decode sizes (=0: not).
FUSE_NEXT_SHRINK = os.environ.get("TOKENMILL_LORA_FUSE_NEXT", "1") not in ("0", "false", "no")
# Steps of more than ROWS_MAX_TOKENS tokens whose adapter tokens all use one slot (eager: known on
# the host; graphs: the one-adapter family) run qkv's and gate_up's LoRA inside their GEMM
# (`triton_concat`: [x | t] @ [W | B]^T, the weight in a wider buffer): no expand, no delta (=0: not).
CONCAT = os.environ.get("TOKENMILL_LORA_CONCAT", "1") not in ("0", "false", "no")
# ... o_proj's and down_proj's too (their input copied into [x | t]: instead of their LoRA beside
# the GEMM into the residual stream), where their weights are wider (=1; the manager then makes them so).
CONCAT_SINKS = os.environ.get("TOKENMILL_LORA_CONCAT_SINKS", "0") not in ("0", "false", "no")
# ... in eager steps (prefill chunks: the slot known on the host) / in the one-slot decode graphs (=0: not)
CONCAT_EAGER = os.environ.get("TOKENMILL_LORA_CONCAT_EAGER", "1") not in ("0", "false", "no")
CONCAT_GRAPHS = os.environ.get("TOKENMILL_LORA_CONCAT_GRAPHS", "1") not in ("0", "false", "no")


class LoRABatch:
    """This step's tokens' adapter slots, shared by every LoRA projection of a model.

    `prepare` is called before each forward pass (eagerly, or inside a captured graph's body,
    which recomputes it from the persistent per-row slots on every replay)."""

    def __init__(self, device: torch.device, num_slots: int = 0) -> None:
        self.device = device
        self.num_slots = num_slots
        self.active = False  # some token of the step has an adapter (always True while capturing)
        self.plan = None  # CUDA + Triton: the step's `triton_lora.StepPlan`, shared by every projection
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # CPU: (slot, its tokens)
        self.token_slots: torch.Tensor | None = None
        self.num_tokens = 0
        self.dense_slot: int | None = None  # every token of this eager step has this slot (`DENSE_MIN_TOKENS`)
        self.shapes: set[tuple[int, int]] = set()  # every projection's (parts * R, in_features)
        # One slot for every adapter token of the step (`CONCAT`): projections with a wider weight
        # run their LoRA inside the GEMM; `concat_slot`: that slot when known on the host (eager
        # steps: its B is put into the weights first), None in a graph (the host did it before the replay).
        self.concat = False
        self.concat_slot: int | None = None
        self.concat_slots: torch.Tensor | None = None  # int32 [T]
        self.concat_ws = None  # triton_concat.ConcatWorkspace
        # A shrink done ahead by the previous projection's kernel: (its input, its planes), consumed
        # by the projection whose input that exact tensor is (gate_up's activation -> down_proj).
        self.ahead: tuple[torch.Tensor, torch.Tensor] | None = None
        # CUDA graphs: the shrinks run on this stream beside the base GEMMs (TOKENMILL_LORA_OVERLAP=0: not);
        # TOKENMILL_LORA_SIDE_PRIORITY=1: at a higher priority (no difference measured on an H200).
        overlap = os.environ.get("TOKENMILL_LORA_OVERLAP", "1") not in ("0", "false", "no")
        high = os.environ.get("TOKENMILL_LORA_SIDE_PRIORITY", "0") not in ("0", "false", "no")
        self.side_stream = side_stream(device, high) if device.type == "cuda" and overlap else None

    def prepare(self, token_slots: torch.Tensor, host: np.ndarray | None = None, single: bool = False) -> None:
        """`token_slots`: int [T] on the device, -1 for tokens without an adapter; `host`: the same
        on the host when known (eager steps), so a step without adapters skips LoRA entirely;
        `single` (graph bodies): every adapter token of the step uses one slot (`CONCAT`)."""
        self.num_tokens = token_slots.shape[0]
        self.ahead = None
        self.dense_slot = None
        self.concat, self.concat_slot = False, None
        if host is not None and not (host >= 0).any():
            self.active = False
            return
        self.active = True
        self.token_slots = token_slots
        if self.device.type == "cuda":
            self.plan = None
            if host is not None and self.num_tokens >= DENSE_MIN_TOKENS and host[0] >= 0 and (host == host[0]).all():
                self.dense_slot = int(host[0])
            if triton_ops.enabled(token_slots) and self.num_slots:
                from tokenmill.layers.lora.triton_lora import plan_step
                self.plan = plan_step(token_slots, self.num_slots, self.shapes)
                self.decide_concat(token_slots, host, single)
            return
        if host is None:
            host = token_slots.cpu().numpy()
        self.groups = []
        for slot in np.unique(host[host >= 0]).tolist():
            rows = np.flatnonzero(host == slot)
            self.groups.append((slot, None if len(rows) == len(host) else torch.from_numpy(rows)))

    def decide_concat(self, token_slots: torch.Tensor, host: np.ndarray | None, single: bool) -> None:
        """Whether this step runs qkv's and gate_up's LoRA inside their GEMMs (`CONCAT`): more tokens
        than the per-token kernels take, every adapter token of one slot (known from `host`, or
        `single` for a graph body of the one-slot family)."""
        from tokenmill.layers.lora import triton_lora
        if not CONCAT or self.num_tokens <= triton_lora.ROWS_MAX_TOKENS or not (CONCAT_GRAPHS if host is None
                                                                                 else CONCAT_EAGER):
            return
        if host is not None:
            used = np.unique(host[host >= 0])
            single = len(used) == 1
            self.concat_slot = int(used[0]) if single else None
        self.concat = single
        if single:
            from tokenmill.layers.lora.triton_concat import ConcatWorkspace
            if self.concat_ws is None:
                self.concat_ws = ConcatWorkspace(self.device)
            self.concat_slots = token_slots.to(torch.int32).contiguous()

    def clear(self) -> None:
        self.active = False
        self.plan = None
        self.ahead = None
        self.dense_slot = None
        self.concat, self.concat_slot, self.concat_slots = False, None, None


class LoRASlots:
    """One projection's adapters: A [slots, parts * R, in], B [slots, out, R] (scaling folded in),
    `part_starts`: the output column where each part (q, k, v or gate, up) starts, then `out`."""

    def __init__(self, batch: LoRABatch, num_slots: int, rank: int, in_features: int, part_sizes: list[int],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.batch = batch
        self.rank = rank
        self.layer: torch.nn.Module | None = None  # the projection (`_plain_weight`)
        self.part_starts = tuple(int(v) for v in np.cumsum([0] + part_sizes))
        out = self.part_starts[-1]
        # The Triton expand needs part boundaries on multiples of 16 (every real model's); else torch.
        self.triton = all(p % 16 == 0 for p in self.part_starts[:-1])
        self.a = torch.zeros(num_slots, len(part_sizes) * rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out, rank, dtype=dtype, device=device)
        # `attach_concat`: the layer's weight as a view of ext [out, in + E] whose last E columns
        # hold slot `ext_slot`'s B (block-diagonal by part; -1: none yet)
        self.ext: torch.Tensor | None = None
        self.ext_slot = -1
        batch.num_slots = max(batch.num_slots, num_slots)
        if self.triton:
            batch.shapes.add((len(part_sizes) * rank, in_features))

    def set_slot(self, slot: int, part: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put one part's A [r, in] and B [out_part, r] into `slot` (None: zeros), rank zero-padded."""
        lo, hi = self.part_starts[part], self.part_starts[part + 1]
        rows = slice(part * self.rank, (part + 1) * self.rank)
        if slot == self.ext_slot:  # the wider weight's B columns no longer hold this slot's B
            self.ext_slot = -1
        self.a[slot, rows].zero_()
        self.b[slot, lo:hi].zero_()
        if a is not None:
            r = a.shape[0]
            self.a[slot, part * self.rank:part * self.rank + r].copy_(a, non_blocking=True)
            self.b[slot, lo:hi, :r].copy_(b, non_blocking=True)

    def attach_concat(self, cuda_only: bool = True) -> bool:
        """Move the layer's weight into a wider buffer `ext` [out, in + E] (the layer keeps a view of
        its first `in` columns) so that one-slot steps run the LoRA inside the GEMM (`CONCAT`).
        Only for a plain weight (unquantized, no bias) on CUDA; False where it does not apply."""
        from tokenmill.layers.lora.triton_concat import ext_columns
        layer = self.layer
        weight = self._base_weight(bias_ok=True)
        if weight is None or (cuda_only and not weight.is_cuda) or not self.triton:
            return False
        n, k = weight.shape
        ext = torch.zeros(n, k + ext_columns(len(self.part_starts) - 1, self.rank), dtype=weight.dtype,
                          device=weight.device)
        ext[:, :k].copy_(weight)
        if isinstance(layer.weight, torch.nn.Parameter):
            layer.weight.data = ext[:, :k]
        else:
            layer.weight = ext[:, :k]
        self.ext, self.ext_slot = ext, -1
        if hasattr(layer, "rebind"):
            layer.rebind()  # (its bound forward holds the weight it had)
        return True

    def load_slot(self, slot: int) -> None:
        """Put slot `slot`'s B into the wider weight's last columns (part i's rows: columns
        in + i * R ..), unless they hold it already."""
        if self.ext is None or self.ext_slot == slot:
            return
        k, rank = self.a.shape[2], self.rank
        for i, (lo, hi) in enumerate(zip(self.part_starts[:-1], self.part_starts[1:])):
            self.ext[lo:hi, k + i * rank:k + (i + 1) * rank].copy_(self.b[slot, lo:hi])
        self.ext_slot = slot

    def _concat(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output plus the step's one slot's deltas: one GEMM over [x | t] and the wider weight."""
        from tokenmill.layers.lora.triton_concat import concat_shrink
        batch = self.batch
        if batch.concat_slot is not None:
            self.load_slot(batch.concat_slot)
        xe = concat_shrink(x, self.a, batch.concat_slots, self.ext.shape[1] - x.shape[1], batch.concat_ws)
        bias = getattr(self.layer, "bias", None)
        return torch.mm(xe, self.ext.t()) if bias is None else torch.addmm(bias, xe, self.ext.t())

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.forward(x, lambda: y)

    def forward(self, x: torch.Tensor, base: Callable[[], torch.Tensor], sink: torch.Tensor | None = None,
                plain: bool = True) -> torch.Tensor:
        """base() (the layer's output for x) plus the step's deltas, added in place; with `sink`
        (a [T, out] tensor y is added to next, before anything reads either) the Triton path adds
        the deltas there instead and returns base() as it is."""
        batch = self.batch
        if not batch.active or x.shape[0] != batch.num_tokens:
            return base()
        if batch.plan is not None and self.triton:
            from tokenmill.layers.lora.triton_expand import lora_expand
            if batch.concat and self.ext is not None and plain and x.stride(1) == 1 and (sink is None or CONCAT_SINKS):
                return self._concat(x)
            if batch.dense_slot is not None:
                weight = self._plain_weight(x) if plain else None
                if weight is not None:
                    return self._dense_under(x, weight, batch.dense_slot)
                return self._dense(x, base(), batch.dense_slot)
            ahead, batch.ahead = batch.ahead, None
            done = ahead[1] if ahead is not None and ahead[0] is x else None  # the previous kernel did this shrink
            if sink is not None and self._use_sink(sink, x):
                return self._into_sink(x, done, sink, base)
            if done is None and self._delta_beside():
                return self._delta_and_base(x, base)
            if done is not None:
                planes, y = done, base()
            else:
                planes, y = self._shrink_and_base(x, base)
            return lora_expand(planes, self.b, batch.plan, y, self.part_starts)
        y = base()
        if batch.device.type == "cuda":  # CUDA without the Triton path: the reference, on the device
            return y.add_(lora_reference(x, self.a, self.b, self.part_starts, batch.token_slots).to(y.dtype))
        return lora_add_grouped(x, y, self.a, self.b, self.part_starts, batch.groups)

    def forward_silu_mul(self, x: torch.Tensor, base: Callable[[], torch.Tensor],
                         act: Callable[[torch.Tensor], torch.Tensor], then: "LoRASlots | None" = None) -> torch.Tensor:
        """act(base() plus the deltas) for a [gate | up] projection, act being SiLU-and-mul: on the
        Triton path the expand and the activation are one kernel (y is read once, never rewritten).
        `then`: the LoRA of the projection the output goes to next (down_proj): at decode sizes the
        same kernel does its shrink too (one launch less per layer; `LoRABatch.ahead`)."""
        batch = self.batch
        halves = len(self.part_starts) == 3 and 2 * self.part_starts[1] == self.part_starts[2]
        if batch.active and x.shape[0] == batch.num_tokens and batch.plan is not None and self.triton and halves:
            from tokenmill.layers.lora.triton_fused import can_fuse_next_shrink, lora_expand_silu
            if batch.concat and self.ext is not None and x.stride(1) == 1:
                return act(self._concat(x))
            if batch.dense_slot is not None and DENSE_FUSED_SILU and self._plain_weight(x) is not None:
                return act(self._dense_under(x, self._plain_weight(x), batch.dense_slot))
            if batch.dense_slot is not None:  # the shrink one GEMM (a plane: no K splits), the rest fused
                planes = torch.mm(x, self.a[batch.dense_slot].t()).float().unsqueeze(0)
                return lora_expand_silu(planes, self.b, batch.plan, base())
            if self._delta_beside():
                from tokenmill.layers.lora.triton_fused import silu_mul_add
                return silu_mul_add(*self._delta_and_base(x, base, add=False))
            planes, y = self._shrink_and_base(x, base)
            inter = self.part_starts[1]
            if (then is not None and then.triton and then.batch is batch and FUSE_NEXT_SHRINK
                    and can_fuse_next_shrink(batch.plan, inter, then.a)):
                out, ahead = lora_expand_silu(planes, self.b, batch.plan, y, next_a=then.a)
                batch.ahead = (out, ahead)
                return out
            return lora_expand_silu(planes, self.b, batch.plan, y)
        return act(self.forward(x, base))

    def _dense(self, x: torch.Tensor, y: torch.Tensor, slot: int) -> torch.Tensor:
        """y += the deltas of one slot for every token: a GEMM for the shrink, one per part adding
        into y's columns (cuBLAS's beta = 1: y read and written once)."""
        shrunk = torch.mm(x, self.a[slot].t())
        b, rank = self.b[slot], self.rank
        for i, (lo, hi) in enumerate(zip(self.part_starts[:-1], self.part_starts[1:])):
            y[:, lo:hi].addmm_(shrunk[:, i * rank:(i + 1) * rank], b[lo:hi].t())
        return y

    def _plain_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """The layer's weight where its base output is exactly x @ weight^T (`DENSE_FUSED`)."""
        weight = self._base_weight() if DENSE_FUSED else None
        if weight is None or weight.dtype != x.dtype or weight.device != x.device:
            return None
        return weight

    def _base_weight(self, bias_ok: bool = False) -> torch.Tensor | None:
        """The layer's weight where its output is exactly x @ weight^T (+ its bias: `bias_ok`; unquantized)."""
        layer = self.layer
        if layer is None or (getattr(layer, "bias", None) is not None and not bias_ok) \
                or getattr(getattr(layer, "quant_method", None), "quantized", True):
            return None
        weight = getattr(layer, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != self.part_starts[-1] \
                or weight.stride(1) != 1:
            return None
        return weight

    def _dense_under(self, x: torch.Tensor, weight: torch.Tensor, slot: int) -> torch.Tensor:
        """x @ weight^T plus one slot's deltas for every token: the delta first (a GEMM for the
        shrink, one per part writing its columns), then the base GEMM adding onto it (beta = 1)."""
        shrunk = torch.mm(x, self.a[slot].t())
        b, rank = self.b[slot], self.rank
        if len(self.part_starts) == 2:
            out = torch.mm(shrunk, b.t())
        else:
            out = torch.empty(x.shape[0], self.part_starts[-1], dtype=x.dtype, device=x.device)
            for i, (lo, hi) in enumerate(zip(self.part_starts[:-1], self.part_starts[1:])):
                torch.mm(shrunk[:, i * rank:(i + 1) * rank], b[lo:hi].t(), out=out[:, lo:hi])
        return out.addmm_(x, weight.t())

    def _use_sink(self, sink: torch.Tensor, x: torch.Tensor) -> bool:
        if SINK_MODE not in ("beside", "always") or sink.shape != (x.shape[0], self.part_starts[-1]) \
                or sink.stride(1) != 1:
            return False
        batch = self.batch
        return SINK_MODE == "always" or (batch.side_stream is not None and batch.num_tokens <= SINK_OVERLAP_MAX_TOKENS)

    def _sink_beside(self) -> bool:
        """Whether the sink's LoRA runs on the side stream (captured, or a large eager step)."""
        batch = self.batch
        return (batch.side_stream is not None and batch.num_tokens <= SINK_OVERLAP_MAX_TOKENS
                and (batch.num_tokens >= SINK_EAGER_MIN_TOKENS or torch.cuda.is_current_stream_capturing()))

    def _into_sink(self, x: torch.Tensor, planes: torch.Tensor | None, sink: torch.Tensor,
                   base: Callable[[], torch.Tensor]) -> torch.Tensor:
        """base(), and the deltas (the shrink unless `planes` holds it) added into `sink`: beside
        base() on the side stream while a small enough CUDA graph is captured."""
        from tokenmill.layers.lora.triton_expand import lora_expand
        from tokenmill.layers.lora.triton_shrink import lora_shrink
        batch = self.batch

        def delta() -> None:
            done = planes if planes is not None else lora_shrink(x, self.a, batch.plan)
            lora_expand(done, self.b, batch.plan, sink, self.part_starts)
        if self._sink_beside():
            return run_beside(batch.side_stream, delta, base)[1]
        y = base()
        delta()
        return y

    def _delta_beside(self) -> bool:
        batch = self.batch
        return (DELTA_BESIDE and batch.side_stream is not None and batch.plan.order is not None
                and batch.num_tokens <= OVERLAP_MAX_TOKENS)

    def _delta_and_base(self, x: torch.Tensor, base: Callable[[], torch.Tensor], add: bool = True):
        """base() plus the deltas: the LoRA (shrink, then the expand writing a buffer of its own)
        beside base() on the side stream while a graph is captured, then one add (add=False:
        (base(), the deltas) for the kernel that adds them itself)."""
        from tokenmill.layers.lora.triton_expand import lora_expand
        from tokenmill.layers.lora.triton_shrink import lora_shrink
        batch = self.batch
        delta = torch.empty(x.shape[0], self.part_starts[-1], dtype=x.dtype, device=x.device)

        def lora() -> None:
            lora_expand(lora_shrink(x, self.a, batch.plan), self.b, batch.plan, delta, self.part_starts, add=False)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            y = run_beside(batch.side_stream, lora, base)[1]
        else:
            lora()
            y = base()
        return y.add_(delta) if add else (y, delta)

    def _shrink_and_base(self, x: torch.Tensor, base: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The shrink's planes and base(): side by side while a CUDA graph is captured."""
        from tokenmill.layers.lora.triton_shrink import lora_shrink
        batch = self.batch
        if (batch.side_stream is not None and batch.num_tokens <= OVERLAP_MAX_TOKENS
                and torch.cuda.is_current_stream_capturing()):
            return run_beside(batch.side_stream, lambda: lora_shrink(x, self.a, batch.plan), base)
        return lora_shrink(x, self.a, batch.plan), base()


def side_stream(device: torch.device, high: bool) -> torch.cuda.Stream:
    return torch.cuda.Stream(device, priority=-1 if high else 0)


def run_beside(side: torch.cuda.Stream, first: Callable, second: Callable) -> tuple:
    """first() on the `side` stream and second() on the current one, both after the work queued so
    far, the current stream then waiting for both (captured in a graph: two parallel branches).
    `first` must allocate nothing (its outputs would belong to the side stream's pool)."""
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        a = first()
    b = second()
    main.wait_stream(side)
    return a, b


def has_lora(layer: torch.nn.Module) -> bool:
    return layer.__dict__.get("lora") is not None
