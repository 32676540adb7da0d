"""CUDA graphs of a step that is one prompt chunk and nothing else: a request's prefill at batch 1.

Run eagerly, a forward pass costs some 300 kernel launches from Python (about 20 ms of host time
for a 30-layer model on the lent H100's CPU, against well under 1 ms of device time for a short
prompt): at batch 1 that, not the device, sets the time to first token. So short chunks replay a
graph captured per padded token count `size`:

- inputs, loaded by one host-to-device copy: the row's slot, its first position, its real token
  count n, its prompt length (LongRoPE's choice of factors), and the n token ids (padding ids are 0);
- positions first .. first + size - 1; the padding positions write no KV (slot -1), and the
  attention sees a context of first + size (queries past n read keys nobody wrote; their rows
  are dropped), so a graph is replayed only when first + size <= max_model_len;
- logits of the last real position only ([1, V]);
- the slot's computed-token count on the device becomes first + n (the caller sets the host's).

With a draft model (`mirror`) the body runs the draft over the same inputs, for its KV.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.worker.graph_capture import capture_per_size, smallest_fitting
from tokenmill.worker.persistent_batch import PersistentBatch, copy_to_device

logger = logging.getLogger(__name__)

# Padded chunk lengths with a graph; longer chunks run eagerly (there the device time dominates).
PROMPT_GRAPH_SIZES = (16, 32, 64, 96, 128, 192, 256, 384, 512)


class PromptGraphs:
    def __init__(self, model: torch.nn.Module, batch: PersistentBatch, kv_caches: list[torch.Tensor],
                 max_model_len: int, block_size: int, max_tokens: int,
                 mirror: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], None] | None = None,
                 lora=None) -> None:
        self.model = model
        self.lora = lora  # LoRAManager: the row's adapter slot is read on the device in the body
        self.batch = batch
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.mirror = mirror
        cap = min(max_tokens, max_model_len, PROMPT_GRAPH_SIZES[-1])  # a step's token budget may be smaller
        self.sizes = [s for s in PROMPT_GRAPH_SIZES if s < cap] + [cap]
        largest = max(self.sizes, default=0)
        device = batch.device
        self._inputs = torch.zeros(4 + largest, dtype=torch.int64, device=device)  # slot, first, n, prompt, ids
        self.slot = self._inputs[:1]  # the row's slot (int64 [1]): the sampler's slots
        self._query_start_loc: dict[int, torch.Tensor] = {
            s: torch.tensor([0, s], dtype=torch.int32, device=device) for s in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.plain_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # with LoRA: for a row without an adapter
        self._plain = False  # capturing (running) the bodies without LoRA
        self.logits: dict[int, torch.Tensor] = {}
        self.plain_logits: dict[int, torch.Tensor] = {}

    def padded_size(self, num_tokens: int, first: int) -> int | None:
        """The graph for a chunk of `num_tokens` starting at position `first`; None: run eagerly."""
        size = smallest_fitting(self.sizes, num_tokens)
        return size if size is not None and first + size <= self.max_model_len else None

    @torch.inference_mode()
    def capture(self) -> None:
        """Every size, largest first, into one pool. The inputs hold n = 0: nothing is written."""
        start = time.perf_counter()
        self.graphs, self.logits = capture_per_size(self.sizes, self._body)
        if self.lora is not None and self.lora.plain_graphs:
            self._plain = True
            try:  # their own logits buffers (a prompt graph's output is its own, not shared)
                self.plain_graphs, self.plain_logits = capture_per_size(self.sizes, self._body)
            finally:
                self._plain = False
        logger.info("captured %d prompt-chunk CUDA graphs (up to %d tokens) in %.1f s", len(self.graphs),
                    max(self.sizes, default=0), time.perf_counter() - start)

    def run(self, slot: int, first: int, token_ids: np.ndarray) -> torch.Tensor:
        """The chunk `token_ids` of slot `slot` at positions from `first`: logits [1, V] of its last
        token (a view of the graph's output)."""
        n = len(token_ids)
        size = self.padded_size(n, first)
        host = np.zeros(4 + size, dtype=np.int64)
        host[:4] = slot, first, n, self.batch.num_prompt[slot]
        host[4:4 + n] = token_ids
        copy_to_device(host, self._inputs[:4 + size])
        plain = bool(self.plain_graphs) and not self.lora.any_adapter(np.array([slot]))
        graphs, logits = (self.plain_graphs, self.plain_logits) if plain else (self.graphs, self.logits)
        graph = graphs.get(size)
        if graph is None:  # not captured (CPU tests): the body itself
            logits[size] = self._body(size)
        else:
            graph.replay()
        return logits[size]

    def _body(self, size: int) -> torch.Tensor:
        batch, bs, inputs = self.batch, self.block_size, self._inputs
        slot, first, n = inputs[0:1], inputs[1], inputs[2]
        offsets = torch.arange(size, device=inputs.device)
        positions = first + offsets
        written = offsets < n
        block_row = batch.block_table_dev.index_select(0, slot)  # [1, W]
        columns = (positions // bs).clamp_max(block_row.shape[1] - 1)
        blocks = block_row[0].gather(0, columns).to(torch.int64)
        slot_mapping = torch.where(written, blocks * bs + positions % bs, -1)
        meta = AttentionMetadata(
            num_tokens=size, max_query_len=size, max_seq_len=self.max_model_len,
            query_start_loc=self._query_start_loc[size], seq_lens=(first + size).to(torch.int32).view(1),
            block_table=block_row, slot_mapping=slot_mapping,
            query_start_loc_cpu=torch.tensor([0, size], dtype=torch.int32),
            seq_lens_cpu=torch.tensor([size], dtype=torch.int32), seq_lens_exact=False,
            prompt_lens=inputs[3:4])
        input_ids = inputs[4:4 + size]
        if self.lora is not None:
            self.lora.prepare_rows(slot, size, plain=self._plain)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if self.mirror is not None:
            self.mirror(input_ids, positions, meta)
        batch.num_computed_dev.index_copy_(0, slot, (first + n).view(1))
        last = (n - 1).clamp_min(0).view(1)
        return self.model.compute_logits(hidden.index_select(0, last))
