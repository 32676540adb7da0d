"""CUDA graphs of pure decode steps: input preparation, forward and logits in one replay.

A decode step's inputs all live on the device already (`PersistentBatch`): each row's position
is its slot's computed-token count, its input the slot's next token, its KV slot a lookup in the
slot's block table row. So the captured body starts from one persistent tensor of row slots
(padded rows point at the scratch slot, which attends to nothing and writes nothing) and the
only host-to-device traffic of a steady decode step is none at all: the slot list is copied
only when the batch changed.

One graph per padded batch size, captured largest first into one memory pool. The attention
backend must be capture-safe (the Triton backend is): a graph replays with max_query_len=1 and
max_seq_len=max_model_len, whatever the actual lengths.

Speculative verification (`query_len` = k + 1, `drafts`: the speculator's [slots, k] drafts):
every row feeds its next token and k drafts, and rows that verify fewer (`num_drafts`, copied
with the slot list) compute the rest as padding that writes no KV; the caller keeps the logits
of the real positions (`verify_logits_rows`). Such a step's positions run up to k past the
row's real ones, so it is replayed only when every row has that room below max_model_len.

With a draft model (`mirror`: the draft's forward over the same inputs, for its KV), the
verification body runs it after the target's, so that the draft's cache has every position the
target's has. Plain decode steps mirror through a family of their own (`kv_only`: the draft
model's decode step, writing its KV and nothing else: no logits, no count advanced), replayed
before the target's only while the draft's state is held (see "Dormant proposer state" in
core/spec_policy.py).

A pipeline stage's graphs cover its own layers: a later stage's body starts from static input
buffers (`input_views`, filled with the previous stage's activations before each replay), and
a stage before the last ends with its activations instead of logits (`PipelineStage.run_graph`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from tokenmill.distributed.layout import RankLayout
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.model.intermediate import IntermediateTensors
from tokenmill.padded_batches import graph_batch_sizes
from tokenmill.worker.graph_capture import capture_per_size, smallest_fitting
from tokenmill.worker.graph_replay_timing import replay_ms
from tokenmill.worker.persistent_batch import PersistentBatch, copy_to_device

logger = logging.getLogger(__name__)

# LoRA: the one-slot decode family is kept only where it replays faster than the general one at
# start-up (`DecodeGraphs._single_pays`; =0: kept without the check).
SINGLE_CHECK = os.environ.get("TOKENMILL_LORA_SINGLE_CHECK", "1") not in ("0", "false", "no")


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, batch: PersistentBatch, kv_caches: list[torch.Tensor],
                 max_num_seqs: int, max_model_len: int, block_size: int, layout: RankLayout | None = None,
                 query_len: int = 1, drafts: torch.Tensor | None = None,
                 mirror: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], None] | None = None,
                 kv_only: bool = False, lora=None) -> None:
        self.model = model
        self.lora = lora  # LoRAManager: the rows' adapter slots are read on the device in the body
        self.mirror = mirror
        self.kv_only = kv_only
        self.query_len = query_len
        self.drafts = drafts
        self.last_stage = layout is None or layout.is_last_stage
        self.batch = batch
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_num_seqs)
        # TP plain decode: the graphs leave each rank's vocab columns of the logits; the greedy
        # tail takes their argmax across ranks without gathering them (`ParallelLMHead.argmax`),
        # other steps gather them after the replay (`whole_logits`).
        self.local_logits = (layout is not None and layout.tp_size > 1 and self.last_stage and query_len == 1
                             and not kv_only and hasattr(model, "logits_head") and model.logits_head.shards_argmax()
                             and os.environ.get("TOKENMILL_TP_SHARDED_ARGMAX", "1") != "0")
        device = batch.device
        largest = self.sizes[-1]
        # The rows' slots (padding: the scratch slot) and draft counts, loaded by one copy.
        self._rows = torch.zeros((2, largest), dtype=torch.int64, device=device)
        self._rows[0] = batch.scratch
        self.slots, self.num_drafts = self._rows[0], self._rows[1]
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device) * query_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # With LoRA: the same bodies without it, replayed for steps none of whose rows has an
        # adapter (a LoRA engine's base requests run as the base model's); same output buffers.
        self.plain_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._plain = False  # capturing (running) the bodies without LoRA
        self.single_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # LoRA: steps of one slot (`LoRAManager.concat`)
        self._single = False
        self.logits: dict[int, torch.Tensor] = {}  # the last stage's output
        self.activations: dict[int, list[torch.Tensor]] = {}  # an earlier stage's output
        # A later pipeline stage's input: the previous stage's activations, copied in before a replay.
        self.inputs: list[torch.Tensor] = []
        if layout is not None and not layout.is_first_stage:
            dtype = getattr(model, "activation_dtype", None) or next(model.parameters()).dtype  # quantized params differ
            self.inputs = [torch.zeros(shape, dtype=dtype, device=device)
                           for shape in model.intermediate_shapes(largest)]
        self._loaded: tuple[int, bytes, bytes] | None = None  # (padded size, slots, drafts) now loaded
        # Every size's graph writes its output into these (made by the largest size's warm-up run,
        # which comes first): an output per size would each keep pool memory of its own, which at
        # a thousand rows of float32 logits adds up to tens of GiB.
        self._outputs: list[torch.Tensor] | None = None

    def padded_size(self, num_rows: int) -> int | None:
        """The smallest captured size that holds `num_rows`; None when none does."""
        return smallest_fitting(self.sizes, num_rows)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self.graphs, outputs = capture_per_size(self.sizes, self._body)
        if self.last_stage:
            self.logits = outputs
        else:
            self.activations = outputs
        if self.lora is not None and self.lora.plain_graphs:
            self._plain = True
            try:  # (their outputs are views of the same buffers: `_outputs`)
                self.plain_graphs, _ = capture_per_size(self.sizes, self._body)
            finally:
                self._plain = False
        if self.lora is not None and self.lora.concat_graphs and self.query_len == 1 and not self.kv_only:
            # steps whose adapter rows all use one slot: qkv's and gate_up's LoRA inside their GEMMs
            self._single = True
            try:
                from tokenmill.layers.lora.triton_lora import ROWS_MAX_TOKENS  # (smaller: the per-token kernels)
                self.single_graphs, _ = capture_per_size([s for s in self.sizes if s > ROWS_MAX_TOKENS], self._body)
            finally:
                self._single = False
            if self.single_graphs and SINGLE_CHECK and not self._single_pays():
                self.single_graphs = {}
        logger.info("captured %d decode CUDA graphs (batch 1..%d, %d query tokens per row) in %.1f s",
                    len(self.graphs), self.sizes[-1], self.query_len, time.perf_counter() - start)

    def _single_pays(self) -> bool:
        """Start-up's A/B: whether the one-slot family replays faster than the general one at the
        largest size, every row of one slot (the padding rows' scratch slot given slot 0 for it;
        both families then do that slot's LoRA work), best of two alternations; logged."""
        size = max(self.single_graphs)
        scratch = self.batch.scratch
        times: dict[str, list[float]] = {"general": [], "single": []}
        self.lora.set_row(scratch, 0)
        self.lora.load_concat(0)
        try:
            for _ in range(2):
                for name, graphs in (("general", self.graphs), ("single", self.single_graphs)):
                    times[name].append(replay_ms(graphs[size], 5))
        finally:
            self.lora.set_row(scratch, -1)
        general, single = min(times["general"]), min(times["single"])
        logger.info("LoRA one-slot decode graphs (LoRA inside qkv's and gate_up's GEMMs), %d rows of one adapter: "
                    "%.3f ms a step vs %.3f for the general graphs: %s", size, single, general,
                    "kept" if single < general else "dropped")
        return single < general

    def input_views(self, num_rows: int) -> list[torch.Tensor]:
        """A later pipeline stage: where the previous stage's activations for `num_rows` rows go."""
        return [t[:num_rows] for t in self.inputs]

    def run(self, slots: np.ndarray, num_drafts: np.ndarray | None = None) -> torch.Tensor | list[torch.Tensor]:
        """Replay the decode step of rows `slots`; logits [len(slots) * query_len, V] (a view of the
        graph's output; with `local_logits` this rank's vocab columns: see `whole_logits`), or on a pipeline stage before the last its activations (views: copy
        before the next replay). Advances every row's computed-token count on the device by
        1 + its drafts (the caller does the host's). `num_drafts`: per row, with `query_len` > 1.
        `kv_only`: writes the KV of the rows' next inputs, returns None, advances nothing."""
        size = self.padded_size(len(slots))
        drafts = b"" if num_drafts is None else num_drafts.tobytes()
        key = (size, slots.tobytes(), drafts)
        if key != self._loaded:  # the batch or its drafts changed: one copy of both padded lists
            rows = np.zeros(self._rows.shape, dtype=np.int64)
            rows[0] = self.batch.scratch
            rows[0, :len(slots)] = slots
            if num_drafts is not None:
                rows[1, :len(slots)] = num_drafts
            copy_to_device(rows, self._rows)
            self._loaded = key
        plain = self.plain_graphs and not self.lora.any_adapter(slots)
        graphs = self.plain_graphs if plain else self.graphs
        if not plain and size in self.single_graphs:
            slot = self.lora.single_slot(slots)
            if slot is not None:
                self.lora.load_concat(slot)
                graphs = self.single_graphs
        graphs[size].replay()
        if self.kv_only:
            return None
        rows = len(slots) * self.query_len
        if not self.last_stage:
            return [t[:rows] for t in self.activations[size]]
        return self.logits[size][:rows]

    def whole_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`run`'s logits over the whole vocabulary (`local_logits`: gathered from the ranks now)."""
        return self.model.logits_head.gather(logits) if self.local_logits else logits

    def _body(self, size: int) -> torch.Tensor | list[torch.Tensor]:
        batch, bs, q = self.batch, self.block_size, self.query_len
        slots = self.slots[:size]
        real = slots != batch.scratch
        base = batch.num_computed_dev[slots]
        block_rows = batch.block_table_dev[slots]
        if q == 1:
            positions, input_ids, written = base, batch.next_token_dev[slots], real
            advance = real.to(torch.int64)
        else:
            offsets = torch.arange(q, device=slots.device)
            positions = (base[:, None] + offsets).reshape(-1)
            input_ids = torch.cat([batch.next_token_dev[slots][:, None], self.drafts[slots, :q - 1]], 1).reshape(-1)
            num_drafts = self.num_drafts[:size]
            written = (real[:, None] & (offsets[None, :] <= num_drafts[:, None])).reshape(-1)
            advance = torch.where(real, num_drafts + 1, 0)
        columns = (positions // bs).clamp_max(block_rows.shape[1] - 1).view(size, q)
        blocks = block_rows.gather(1, columns).reshape(-1).to(torch.int64)
        slot_mapping = torch.where(written, blocks * bs + positions % bs, -1)
        seq_lens = torch.where(real, base + q, 0).to(torch.int32)
        meta = AttentionMetadata(
            num_tokens=size * q, max_query_len=q, max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=seq_lens, block_table=block_rows,
            slot_mapping=slot_mapping, query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32) * q,
            seq_lens_cpu=torch.full((size,), q, dtype=torch.int32), seq_lens_exact=False,
            prompt_lens=torch.zeros_like(seq_lens))  # every token is past its prompt: its own position decides
        if self.lora is not None:
            self.lora.prepare_rows(slots, q, plain=self._plain, single=self._single)
        if self.inputs:
            out = self.model(input_ids, positions, self.kv_caches, meta,
                             IntermediateTensors.of([t[:size] for t in self.inputs]))
        else:
            out = self.model(input_ids, positions, self.kv_caches, meta)
        if self.kv_only:
            return None
        if self.mirror is not None:
            self.mirror(input_ids, positions, meta)
        batch.num_computed_dev.index_add_(0, slots, advance)
        if not self.last_stage:
            return self._into_outputs(out.tensors())
        gather = not self.local_logits
        if self._outputs is None:
            self._outputs = [self.model.compute_logits(out, gather=gather)]
        return self.model.compute_logits(out, out=self._outputs[0][:out.shape[0]], gather=gather)

    def _into_outputs(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if self._outputs is None:
            self._outputs = [torch.empty_like(t) for t in tensors]
        return [buf[:t.shape[0]].copy_(t) for buf, t in zip(self._outputs, tensors)]


def verify_logits_rows(num_drafts: np.ndarray, query_len: int) -> np.ndarray:
    """Rows of a verification graph's logits that are real positions: row r's first 1 + num_drafts[r]."""
    per_row = num_drafts + 1
    starts = np.arange(len(num_drafts)) * query_len
    return np.repeat(starts, per_row) + (np.arange(per_row.sum()) - np.repeat(np.cumsum(per_row) - per_row, per_row))
