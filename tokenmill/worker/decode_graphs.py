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

A pipeline stage's graphs cover its own layers: a later stage's body starts from static input
buffers (`input_views`, filled with the previous stage's activations before each replay), and
a stage before the last ends with its activations instead of logits (`PipelineStage.run_graph`).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tokenmill.distributed.layout import RankLayout
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.model.intermediate import IntermediateTensors
from tokenmill.worker.persistent_batch import PersistentBatch, to_device

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, batch: PersistentBatch, kv_caches: list[torch.Tensor],
                 max_num_seqs: int, max_model_len: int, block_size: int, layout: RankLayout | None = None) -> None:
        self.model = model
        self.last_stage = layout is None or layout.is_last_stage
        self.batch = batch
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_num_seqs)
        device = batch.device
        largest = self.sizes[-1]
        self.slots = torch.full((largest,), batch.scratch, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # the last stage's output
        self.activations: dict[int, list[torch.Tensor]] = {}  # an earlier stage's output
        # A later pipeline stage's input: the previous stage's activations, copied in before a replay.
        self.inputs: list[torch.Tensor] = []
        if layout is not None and not layout.is_first_stage:
            dtype = next(model.parameters()).dtype
            self.inputs = [torch.zeros(shape, dtype=dtype, device=device)
                           for shape in model.intermediate_shapes(largest)]
        self._loaded: tuple[int, bytes] | None = None  # (padded size, slots) now in `self.slots`

    def padded_size(self, num_rows: int) -> int | None:
        """The smallest captured size that holds `num_rows`; None when none does."""
        if num_rows > self.sizes[-1]:
            return None
        return next(s for s in self.sizes if s >= num_rows)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._body(size)  # warm-up: compiles kernels, settles the allocator
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self._body(size)
                if self.last_stage:
                    self.logits[size] = out
                else:
                    self.activations[size] = out
                self.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s", len(self.graphs),
                    self.sizes[-1], time.perf_counter() - start)

    def input_views(self, num_rows: int) -> list[torch.Tensor]:
        """A later pipeline stage: where the previous stage's activations for `num_rows` rows go."""
        return [t[:num_rows] for t in self.inputs]

    def run(self, slots: np.ndarray) -> torch.Tensor | list[torch.Tensor]:
        """Replay the decode step of rows `slots`; logits [len(slots), V] (a view of the graph's output),
        or on a pipeline stage before the last its activations (views: copy before the next replay).
        Advances every row's computed-token count on the device (the caller does the host's)."""
        size = self.padded_size(len(slots))
        key = (size, slots.tobytes())
        if key != self._loaded:  # the batch changed: one copy of the padded slot list
            padded = np.full(size, self.batch.scratch, dtype=np.int64)
            padded[:len(slots)] = slots
            self.slots[:size].copy_(to_device(padded, self.slots.device), non_blocking=True)
            self._loaded = key
        self.graphs[size].replay()
        if not self.last_stage:
            return [t[:len(slots)] for t in self.activations[size]]
        return self.logits[size][:len(slots)]

    def _body(self, size: int) -> torch.Tensor | list[torch.Tensor]:
        batch, bs = self.batch, self.block_size
        slots = self.slots[:size]
        positions = batch.num_computed_dev[slots]
        input_ids = batch.next_token_dev[slots]
        real = slots != batch.scratch
        block_rows = batch.block_table_dev[slots]
        blocks = block_rows.gather(1, (positions // bs)[:, None]).squeeze(1).to(torch.int64)
        slot_mapping = torch.where(real, blocks * bs + positions % bs, -1)
        seq_lens = torch.where(real, positions + 1, 0).to(torch.int32)
        meta = AttentionMetadata(
            num_tokens=size, max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=seq_lens, block_table=block_rows,
            slot_mapping=slot_mapping, query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.ones(size, dtype=torch.int32))
        if self.inputs:
            out = self.model(input_ids, positions, self.kv_caches, meta,
                             IntermediateTensors.of([t[:size] for t in self.inputs]))
        else:
            out = self.model(input_ids, positions, self.kv_caches, meta)
        batch.num_computed_dev.index_add_(0, slots, real.to(torch.int64))
        if not self.last_stage:
            return out.tensors()
        return self.model.compute_logits(out)
