"""A worker's LoRA adapters: device slots attached to the model's projections, a host-memory LRU
of adapters already read (and sliced for this rank), and each step's token -> slot map.

The engine core decides which adapter goes in which slot (`tokenmill.lora.slots`) and sends a
`LoRALoad` with the step that first needs it; the worker copies the adapter in before running
the step (from the host LRU; read from its PEFT folder first when not there). Each request row
carries its slot (`NewRequestData.lora_slot`), kept here per persistent-batch slot on the host
and on the device, so a CUDA graph's body computes its tokens' adapter slots on the device on
every replay: the graphs hold fixed-shape buffers and never depend on the adapter mix.

Tensor parallelism: a column-parallel projection (qkv, gate_up) holds the full A and this
rank's rows of B; a row-parallel one (o, down) this rank's input columns of A and the full B,
its delta summed with the base's partial output by the same all-reduce.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from tokenmill.config import LoRAConfig, ModelArch
from tokenmill.layers.lora import lora_layer
from tokenmill.layers.lora.lora_layer import LoRABatch, LoRASlots
from tokenmill.lora.peft import TARGETS, load_adapter, read_adapter
from tokenmill.protocol import LoRALoad, LoRARef
from tokenmill.worker.persistent_batch import to_device

logger = logging.getLogger(__name__)

# tokenmill's LoRA-capable module -> (its parent in the decoder layer, its HF parts in order).
_MODULES = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}


_COLUMN = ("qkv_proj", "gate_up_proj")  # column-parallel: each rank's bias is its own

# Adapters read ahead at once (threads: the file reads, dtype conversions and pinned copies release
# the GIL). One at a time, 64 Llama-8B-sized adapters took 13.6 s to load on an H100 host.
READ_THREADS = 4


def kernel_rank(max_lora_rank: int) -> int:
    """The padded rank of the slot buffers: a power of two, at least 16 (the kernels' dot width)."""
    return max(16, 1 << (max_lora_rank - 1).bit_length())


def packed(pairs: dict, dtype: torch.dtype, pin: bool, scaling: float = 1.0) -> dict:
    """Every (A, B * scaling) of an adapter in `dtype`, as contiguous views of one flat host buffer
    (pinned on CUDA: one page-locked allocation per adapter rather than one per tensor), each
    converted in one pass from the file's dtype. B's product is rounded once, as a float32 product
    rounded to `dtype` (reading 64 Llama-8B-sized adapters took 13.6 s on an H100 host with a
    float32 copy of every tensor first and a page-locked allocation per tensor)."""
    total = sum(a.numel() + b.numel() for a, b in pairs.values())
    flat = torch.empty(total, dtype=dtype, pin_memory=pin)
    out, at = {}, 0
    for key, (a, b) in pairs.items():
        view_a = flat[at:at + a.numel()].view(a.shape)
        view_a.copy_(a)
        at += a.numel()
        view_b = flat[at:at + b.numel()].view(b.shape)
        if b.dtype == dtype or b.dtype == torch.float32:  # (computed in float32: bf16/fp16 ops widen)
            torch.mul(b, scaling, out=view_b)
        else:  # a narrower file dtype than the model's: widen first
            view_b.copy_(b.float() * scaling)
        at += b.numel()
        out[key] = (view_a, view_b)
    return out


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, arch: ModelArch, max_rows: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.config, self.arch = model, config, arch
        self.device, self.dtype = device, dtype
        self.batch = LoRABatch(device, config.max_loras)
        self.rank = kernel_rank(config.max_lora_rank)
        self.slots: dict[tuple[int, str], LoRASlots] = {}
        layout = model.layout
        for i in range(layout.layer_start, layout.layer_end):
            layer = model.model.layers[i]
            for name, (parent, _) in _MODULES.items():
                module = getattr(getattr(layer, parent), name)
                parts = model._shard_sizes(name) if name in ("qkv_proj", "gate_up_proj") else [module.out_features]
                slots = LoRASlots(self.batch, config.max_loras, self.rank, module.in_features, parts, dtype, device)
                module.lora = slots
                slots.layer = module  # (its weight: the dense path's base GEMM, `LoRASlots._plain_weight`)
                self.slots[(i, name)] = slots
        # qkv's and gate_up's weights in wider buffers: one-slot steps run their LoRA inside the GEMM.
        # (o_proj's and down_proj's too with CONCAT_SINKS, where they have no bias: a row-parallel
        # layer adds its bias on the first rank only)
        wider = ("qkv_proj", "gate_up_proj") + (("o_proj", "down_proj") if lora_layer.CONCAT_SINKS else ())
        self.concat = [s for (_, name), s in self.slots.items() if name in wider and lora_layer.CONCAT
                       and device.type == "cuda" and (name in _COLUMN or getattr(s.layer, "bias", None) is None)
                       and s.attach_concat()]
        # Per persistent-batch row (the last is the scratch row of padded graph rows): its adapter slot.
        self.row_slot = np.full(max_rows + 1, -1, dtype=np.int64)
        self.row_slot_dev = torch.full((max_rows + 1,), -1, dtype=torch.int32, device=device)
        # The graph families also capture their bodies without LoRA, for steps without adapters
        # (TOKENMILL_LORA_PLAIN_GRAPHS=0: not; their LoRA kernels then run and find no rows).
        self.plain_graphs = os.environ.get("TOKENMILL_LORA_PLAIN_GRAPHS", "1") not in ("0", "false", "no")
        self.host: OrderedDict[int, dict] = OrderedDict()  # adapter id -> this rank's tensors (LRU)
        self.held: list[LoRARef | None] = [None] * config.max_loras
        self.num_reads = 0  # adapters read from disk (tests: evictions of the host LRU)
        self._reader: ThreadPoolExecutor | None = None  # reads ahead, off the step's path (READ_THREADS at once)
        self._reading: dict[int, Future] = {}
        self.num_read_ahead = 0  # loads served by a read ahead (not waiting for the disk in the step)
        logger.info("LoRA: %d device slots of rank %d on %d projections, %d adapters in host memory; %d projections "
                    "with one slot's LoRA inside their GEMM", config.max_loras, self.rank, len(self.slots),
                    config.max_cpu_loras, len(self.concat))

    # ------------------------------------------------------------------ adapters

    def load(self, loads: list[LoRALoad]) -> None:
        for load in loads:
            weights = self._host_weights(load.lora)
            for (layer, name), slots in self.slots.items():
                for part, hf in enumerate(_MODULES[name][1]):
                    a, b = weights.get((layer, hf), (None, None))
                    slots.set_slot(load.slot, part, a, b)
            self.held[load.slot] = load.lora

    def read_ahead(self, loras: list[LoRARef]) -> None:
        """Start reading adapters into host memory on a background thread (the engine core asks
        when their first request arrives); a failure shows when the adapter is loaded."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="lora-read")
        for lora in loras:
            if (lora.id not in self.host and lora.id not in self._reading
                    and len(self._reading) < self.config.max_cpu_loras):
                self._reading[lora.id] = self._reader.submit(self._read, lora)

    def _host_weights(self, lora: LoRARef) -> dict:
        cached = self.host.get(lora.id)
        if cached is not None:
            self.host.move_to_end(lora.id)
            return cached
        reading = self._reading.pop(lora.id, None)
        self.num_read_ahead += reading is not None
        weights = reading.result() if reading is not None else self._read(lora)
        self.num_reads += 1
        self.host[lora.id] = weights
        while len(self.host) > self.config.max_cpu_loras:
            self.host.popitem(last=False)
        return weights

    def _read(self, lora: LoRARef) -> dict:
        """The adapter's tensors for this rank, in the model's dtype (pinned on CUDA)."""
        adapter = read_adapter(lora.path, self.arch, self.config.max_lora_rank, lora.name)
        pairs = {}
        layout = self.model.layout
        for (layer, hf), (a, b) in load_adapter(adapter).items():
            if layout.layer_start <= layer < layout.layer_end:
                pairs[(layer, hf)] = self._shard(layer, hf, a, b)
        return packed(pairs, self.dtype, pin=self.device.type == "cuda", scaling=adapter.scaling)

    def _shard(self, layer: int, hf: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a (full) pair, sliced as the base weight is (`_source_slice`)."""
        fused, part, kind = TARGETS[hf]
        parent = _MODULES[fused][0]
        shard = part if fused in ("qkv_proj", "gate_up_proj") else None
        where = self.model._source_slice(f"model.layers.{layer}.{parent}.{fused}.weight", shard)
        if where is None:
            return a, b
        dim, start, length = where
        if kind == "column":  # the weight's output rows: B's rows
            return a, b.narrow(0, start, length)
        return a.narrow(1, start, length), b  # the weight's input columns: A's columns

    # ------------------------------------------------------------------ rows and steps

    def set_row(self, row: int, lora_slot: int) -> None:
        if self.row_slot[row] != lora_slot:
            self.row_slot[row] = lora_slot
            self.row_slot_dev[row] = lora_slot

    def prepare_eager(self, token_rows: np.ndarray) -> None:
        """Before an eager forward: `token_rows`, each token's persistent-batch row."""
        host = self.row_slot[token_rows]
        self.batch.prepare(to_device(host, self.device) if (host >= 0).any() else torch.empty(len(host)), host)

    def any_adapter(self, rows: np.ndarray) -> bool:
        """Whether some of these persistent-batch rows has an adapter (else a graph without LoRA)."""
        return bool((self.row_slot[rows] >= 0).any())

    @property
    def concat_graphs(self) -> bool:
        """Whether the decode graphs get a one-slot family (`DecodeGraphs.single_graphs`)."""
        return bool(self.concat) and lora_layer.CONCAT_GRAPHS

    def single_slot(self, rows: np.ndarray) -> int | None:
        """The one slot of these rows' adapters when they have exactly one (rows without one aside)."""
        used = self.row_slot[rows]
        used = used[used >= 0]
        return int(used[0]) if len(used) and (used == used[0]).all() else None

    def load_concat(self, slot: int) -> None:
        """Before replaying a one-slot graph: the slot's B in every wider weight (a no-op when there)."""
        for slots in self.concat:
            slots.load_slot(slot)

    def prepare_rows(self, rows: torch.Tensor, query_len: int = 1, plain: bool = False, single: bool = False) -> None:
        """Inside a graph body: the rows' (device) slots, `query_len` tokens each; `plain`: a body
        without LoRA (`plain_graphs`); `single`: every adapter row uses one slot (`load_concat` before each replay)."""
        if plain:
            self.batch.clear()
            return
        slots = self.row_slot_dev[rows]
        if query_len > 1:
            # contiguous(): one row's expand would reshape to a stride-0 view, which the kernels
            # (indexing slots by token) would read past.
            slots = slots[:, None].expand(-1, query_len).contiguous().view(-1)
        self.batch.prepare(slots, single=single)

    def warm_up(self) -> None:
        """CUDA: compile the kernels for every projection shape, per-token and both tile sizes."""
        seen = set()
        for slots in self.slots.values():
            key = (slots.a.shape, slots.b.shape, slots.part_starts)
            if key in seen:
                continue
            seen.add(key)
            for tokens in (1, 64, 1024):
                x = torch.zeros(tokens, slots.a.shape[2], dtype=self.dtype, device=self.device)
                y = torch.zeros(tokens, slots.b.shape[1], dtype=self.dtype, device=self.device)
                self.batch.prepare(torch.zeros(tokens, dtype=torch.int64, device=self.device))
                slots.apply(x, y)
                if len(slots.part_starts) == 3:  # gate_up's expand fused with SiLU-and-mul
                    slots.forward_silu_mul(x, lambda: y, lambda t: t)
                if slots.ext is not None and tokens > 16:  # the one-slot path (`concat`): [x | t] and its GEMM
                    self.batch.prepare(torch.zeros(tokens, dtype=torch.int64, device=self.device), single=True)
                    slots.apply(x, y)
        # gate_up's kernel with down_proj's shrink in it (decode sizes), and down_proj taking it.
        for (layer, name), slots in self.slots.items():
            down = self.slots.get((layer, "down_proj"))
            if name != "gate_up_proj" or down is None:
                continue
            x = torch.zeros(1, slots.a.shape[2], dtype=self.dtype, device=self.device)
            y = torch.zeros(1, slots.b.shape[1], dtype=self.dtype, device=self.device)
            self.batch.prepare(torch.zeros(1, dtype=torch.int64, device=self.device))
            out = slots.forward_silu_mul(x, lambda: y, lambda t: t, then=down)
            down.apply(out, torch.zeros(1, down.b.shape[1], dtype=self.dtype, device=self.device))
            break
        self.batch.clear()
        torch.cuda.synchronize()
