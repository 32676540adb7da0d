"""This worker's pipeline stage: where its step's activations come from and where they go.

The first stage embeds the step's input ids; a later stage first receives the previous stage's
activations (`IntermediateTensors`, sent point to point by the rank with the same TP index),
then runs its layers; a stage before the last sends its output on and has nothing to sample.
Each stage takes the steps in the order the engine core sent them, so while stage s+1 runs
step N, stage s is already running step N+1: that is the pipeline.

Decode inputs: only the last stage samples, so the first stage cannot find a sampled token in
its slot's `next_token` as a single process does. With pipeline parallelism the scheduler never
schedules a token before it knows it, and sends each row's first input token
(`SchedulerOutput.pp_input_tokens`); `apply_input_tokens` writes the ones the worker lacks into
`next_token`, so every later step (eager or a graph replay) reads them as usual.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from tokenmill.distributed.parallel_state import ParallelContext
from tokenmill.distributed.pp_tokens import DeviceTokens
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.metrics.telemetry import Telemetry
from tokenmill.model.intermediate import IntermediateTensors
from tokenmill.protocol import SchedulerOutput
from tokenmill.worker.persistent_batch import PersistentBatch, to_device


class PipelineStage:
    def __init__(self, parallel: ParallelContext, telemetry: Telemetry | None = None) -> None:
        self.parallel = parallel
        self.layout = parallel.layout
        self.telemetry = telemetry
        self.num_stages = parallel.layout.pp_size
        self._sent = telemetry.channel("activations_sent") if telemetry is not None else None
        self._received = telemetry.channel("activations_received") if telemetry is not None else None
        self._tokens: DeviceTokens | None = None
        # Device tokens: per step that had them, its rows whose input came from the last stage (4 bytes each).
        self._placeholders = telemetry.channel("pp_placeholder_rows") if telemetry is not None else None

    def drain_tokens(self) -> None:
        """At shutdown: the sampled tokens' sends and receives all matched and done."""
        if self._tokens is not None:
            self._tokens.drain()

    def count_placeholders(self, rows: int) -> None:
        if rows and self._placeholders is not None:
            self._placeholders.decoded(4 * rows, 0.0)

    def device_tokens(self, device: torch.device) -> DeviceTokens | None:
        """This rank's end of the sampled tokens' path (first or last stage, device tokens on), or None."""
        group = self.parallel.token_group
        if group is None:
            return None
        if self._tokens is None:
            layout = self.layout
            last = (layout.pp_size - 1) * layout.tp_size + layout.tp_rank
            self._tokens = DeviceTokens(group, layout.tp_rank, last, layout.is_first_stage, device,
                                        self.parallel.p2p_log)
        return self._tokens

    @property
    def is_last(self) -> bool:
        return self.layout.is_last_stage

    def run(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            kv_caches: list[torch.Tensor], meta: AttentionMetadata, step_id: int = 0) -> torch.Tensor | None:
        """The last stage's final hidden states; None on earlier stages (their output went on)."""
        if self.num_stages == 1:
            return model(input_ids, positions, kv_caches, meta)
        intermediate = None
        if not self.layout.is_first_stage:
            intermediate = self._receive(model, meta.num_tokens, positions.device, step_id)
        start = time.perf_counter()
        out = model(input_ids, positions, kv_caches, meta, intermediate)
        if self.telemetry is not None:  # the trace's view of the stage at work (host time)
            self.telemetry.record("stage_compute", start, time.perf_counter(), {"step": step_id})
        if self.is_last:
            return out
        self._send(out, step_id)
        return None

    def run_graph(self, graphs, slots: np.ndarray, on_device_work: Callable[[], None] | None,
                  step_id: int = 0) -> torch.Tensor | None:
        """A decode step as a CUDA graph replay (`DecodeGraphs`): logits on the last stage; None on
        earlier stages (their output went on). A later stage copies the previous stage's
        activations into the graph's input buffers first; an earlier one sends copies of its
        outputs, which the next replay overwrites."""
        if self.num_stages == 1:
            if on_device_work is not None:
                on_device_work()
            return graphs.run(slots)
        if not self.layout.is_first_stage:
            buffers = graphs.input_views(len(slots))
            received = self._receive_tensors([tuple(b.shape) for b in buffers], buffers[0].dtype,
                                             buffers[0].device, step_id)
            for buffer, tensor in zip(buffers, received):
                buffer.copy_(tensor)
        if on_device_work is not None:
            on_device_work()
        out = graphs.run(slots)
        if self.is_last:
            return out
        self._send(IntermediateTensors.of([t.clone() for t in out]), step_id)
        return None

    def _receive(self, model, num_tokens: int, device: torch.device, step_id: int) -> IntermediateTensors:
        dtype = getattr(model, "activation_dtype", None) or next(model.parameters()).dtype  # quantized params differ
        return IntermediateTensors.of(self._receive_tensors(model.intermediate_shapes(num_tokens), dtype, device,
                                                            step_id))

    def _receive_tensors(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                         step_id: int) -> list[torch.Tensor]:
        start = time.perf_counter()
        tensors = self.parallel.recv_prev(shapes, dtype, device)
        if self.telemetry is not None:
            end = time.perf_counter()
            self._received.decoded(sum(t.numel() * t.element_size() for t in tensors), end - start)
            self.telemetry.record("stage_recv", start, end, {"step": step_id})
        return tensors

    def _send(self, out: IntermediateTensors, step_id: int) -> None:
        start = time.perf_counter()
        tensors = out.tensors()
        if self._tokens is not None and self._tokens.is_first:
            # The earlier steps' token receives go first (pp_tokens.py: the order both ranks keep),
            # polling only after this step's forward pass.
            self._tokens.post_pending()
        self.parallel.send_next(tensors)
        if self.telemetry is not None:
            end = time.perf_counter()
            self._sent.encoded(sum(t.numel() * t.element_size() for t in tensors), end - start)
            self.telemetry.record("stage_send", start, end, {"step": step_id})


def apply_input_tokens(so: SchedulerOutput, batch: PersistentBatch) -> int:
    """Write each row's first input token into its slot's `next_token` on the device, where a
    single process's sampler would have put it, for rows whose input is not on the host (a
    token sampled since the request was sent). Decode rows then run as in one process: eagerly,
    or as a CUDA graph replay. Returns how many rows were placeholders (-1: their token came from
    the last stage on the devices)."""
    if not so.pp_input_tokens:
        return 0
    tokens = np.frombuffer(so.pp_input_tokens, dtype="<i4")
    slots = batch.slots(so.scheduled_handles)
    # -1: a placeholder, whose token the first stage took from the last (pipeline device tokens)
    missing = np.flatnonzero((batch.num_computed[slots] >= batch.num_known[slots]) & (tokens >= 0))
    if len(missing):
        pairs = to_device(np.stack([slots[missing], tokens[missing].astype(np.int64)]), batch.device)
        batch.next_token_dev[pairs[0]] = pairs[1]
    return int(np.count_nonzero(tokens < 0))
