"""Turns each SchedulerOutput into one forward pass and sampled tokens, on a persistent batch.

Per step: apply the scheduler's diffs to the slots (`PersistentBatch`) and to the sampler's
per-slot state, then run either
- a pure decode step as one CUDA graph replay (inputs prepared on the device), or
- any other step through host-built inputs (`step_inputs.py`), eagerly;
then sample on the device, write each sampled id into its slot's next input, and start copying
the ids to the host on a side stream. `launch` returns a `PendingStep` without waiting for that
copy, so the caller can launch the next step first (async scheduling): nothing in the hot path
waits for the host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.cpu_threads import StepThreads
from tokenmill.distributed.parallel_state import ParallelContext
from tokenmill.layers.attention.backend import AttentionBackend, kv_cache_shape
from tokenmill.layers.sampling import Sampler, SamplingState
from tokenmill.model.loader import load_model
from tokenmill.protocol import NewRequestData, SchedulerOutput
from tokenmill.protocol.batch_diff import BatchOrder
from tokenmill.worker.decode_graphs import DecodeGraphs
from tokenmill.worker.pending_step import PendingStep, prompt_logprobs
from tokenmill.worker.persistent_batch import PersistentBatch
from tokenmill.worker.pp_stage import PipelineStage, apply_input_tokens
from tokenmill.worker.readback import Readback
from tokenmill.worker.step_diffs import apply_step_diffs
from tokenmill.worker.step_inputs import build_step_inputs
from tokenmill.worker.warmup import profile_and_budget, warm_up_kernels

logger = logging.getLogger(__name__)


def attention_backend_class(name: str) -> type[AttentionBackend]:
    if name == "triton":
        from tokenmill.layers.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend
    from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend
    return TorchRefAttentionBackend


class ModelRunner:
    def __init__(self, config: EngineConfig, stage: PipelineStage | None = None,
                 device: torch.device | None = None) -> None:
        """`stage`: this rank's part of a split model (default: the whole model, one rank)."""
        self.config = config
        self.device = device or config.torch_device
        self.dtype = config.model.torch_dtype
        self.block_size = config.cache.block_size
        arch = config.model.arch
        self.stage = stage or PipelineStage(ParallelContext.single(arch))
        layout = self.stage.layout  # this rank's layers and KV heads
        self.num_layers, self.num_kv_heads, self.head_dim = layout.num_layers, layout.num_kv_heads, arch.head_dim
        max_seqs = config.scheduler.max_num_seqs
        self.batch = PersistentBatch(max_seqs, -(-config.model.max_model_len // self.block_size), self.device)
        self.sampling = SamplingState(max_seqs, arch.vocab_size, config.model.eos_token_ids, self.device)
        self.sampler = Sampler(self.sampling)
        self.readback = Readback(self.device)
        self.batch_order = BatchOrder()
        self.kv_caches: list[torch.Tensor] = []
        self.model: torch.nn.Module | None = None
        self.graphs: DecodeGraphs | None = None
        self.on_device_work: Callable[[], None] | None = None  # called as each step's device work starts
        self.last_timings: dict[str, float] = {}
        self.num_placeholders_filled = 0  # decode inputs taken from a step not yet read back (async)
        self._pending: PendingStep | None = None  # the last step whose ids are not on the host yet
        self._slots = np.zeros(0, dtype=np.int64)  # the last step's rows, as slots
        self._step_threads: StepThreads | None = None

    @property
    def states(self) -> dict[int, int]:
        """Handle -> slot of every request this worker holds (for tests and the debug digest)."""
        return self.batch.slot_of

    def mirror_view(self, handle: int) -> tuple[int, np.ndarray] | None:
        """(tokens computed, block ids) of a request, for the debug digest."""
        slot = self.batch.slot_of.get(handle)
        if slot is None:
            return None
        return int(self.batch.num_computed[slot]), self.batch.block_table[slot, :self.batch.num_blocks[slot]]

    # ------------------------------------------------------------------ setup

    def load_model(self) -> None:
        m = self.config.model
        start = time.perf_counter()
        self.model = load_model(m.path, m.arch, m.load_format, self.dtype, self.device,
                                attention_backend_class(self.config.attention_backend), seed=m.seed,
                                parallel=self.stage.parallel)
        logger.info("loaded %s in %.1f s (%s attention)", m.path, time.perf_counter() - start,
                    self.config.attention_backend)

    def kv_block_bytes(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def available_kv_blocks(self) -> int:
        """How many KV blocks the memory budget allows."""
        if self.config.cache.num_blocks_override:
            return self.config.cache.num_blocks_override
        if self.device.type == "cuda":
            budget = profile_and_budget(self)
        else:
            budget = self.config.cache.cpu_kv_cache_bytes
        return max(budget // self.kv_block_bytes(), 0)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the pool; on CUDA, also compile every kernel and capture the decode graphs,
        so that the first request runs as fast as any later one."""
        self.allocate_kv_cache(num_blocks)
        if self.device.type != "cuda":
            return
        warm_up_kernels(self)
        if not self.config.enforce_eager and self.config.attention_backend == "triton":
            self.graphs = DecodeGraphs(self.model, self.batch, self.kv_caches, self.config.scheduler.max_num_seqs,
                                       self.config.model.max_model_len, self.block_size, self.stage.layout)
            self.graphs.capture()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.num_layers)]

    # ------------------------------------------------------------------ RequestMirror

    def add(self, data: NewRequestData) -> None:
        slot = self.batch.add(data)
        tokens = self.batch.tokens[slot]
        self.sampling.add(slot, data.sampling_params, tokens[:data.num_prompt_tokens],
                          tokens[data.num_prompt_tokens:])

    def drop(self, handle: int) -> None:
        slot = self.batch.remove(handle)
        if slot is not None:
            self.sampling.remove(slot)

    def append_blocks(self, handle: int, block_ids: np.ndarray) -> None:
        self.batch.append_blocks(self.batch.slot_of[handle], block_ids)

    # ------------------------------------------------------------------ step

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> PendingStep:
        """Start a step; its sampled ids stay on the device until `output()` is asked for."""
        timings = self.last_timings = {}
        start = time.perf_counter()
        changed = so.batch is not None or so.new_requests or so.finished_handles or so.preempted_handles
        apply_step_diffs(so, self.batch_order, self)
        apply_input_tokens(so, self.batch)
        self.batch.flush()
        self.sampling.flush()
        prev, self._pending = self._pending, None
        if not len(so.batch_handles):
            self._slots = np.zeros(0, dtype=np.int64)
            if prev is not None:
                prev.output()
            return PendingStep.empty(so.step_id)
        if changed or len(self._slots) != len(so.batch_handles):
            self._slots = self.batch.slots(so.batch_handles.tolist())
        slots = self._slots
        counts = so.batch_counts.astype(np.int64)
        if self.device.type == "cpu":
            self._cpu_threads().apply()
        graphs = self.graphs
        one_token_each = so.batch is None or not so.batch.count_rows
        use_graph = (graphs is not None and one_token_each and graphs.padded_size(len(slots)) is not None
                     and self.batch.all_decode(slots))
        timings["prepare"] = time.perf_counter() - start
        start = time.perf_counter()
        step_prompt_logprobs = []
        if use_graph:
            logits = self.stage.run_graph(graphs, slots, self.on_device_work, so.step_id)
            self.batch.num_computed[slots] += 1
            if logits is None:  # a pipeline stage before the last: its output went on to the next
                timings["forward"] = time.perf_counter() - start
                return PendingStep.empty(so.step_id)
            sample_rows = np.arange(len(slots))
            sample_slots = graphs.slots[:len(slots)]
            num_device_inputs = len(slots)
        else:
            inputs = build_step_inputs(self.batch, slots, counts, self.block_size)
            hidden = self.stage.run(self.model, inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                                    so.step_id)
            if hidden is None:  # a pipeline stage before the last: its output went on to the next
                timings["forward"] = time.perf_counter() - start
                return PendingStep.empty(so.step_id)
            if self.batch.num_prompt_logprobs:
                step_prompt_logprobs = prompt_logprobs(self, slots, counts, hidden, inputs.meta)
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            sample_rows, sample_slots = inputs.sample_rows, inputs.sample_slots
            num_device_inputs = inputs.num_device_inputs
        timings["forward"] = time.perf_counter() - start
        start = time.perf_counter()
        if prev is not None and not prev.on_host:
            self.num_placeholders_filled += num_device_inputs
        step = PendingStep(self, so.step_id, len(slots), sample_rows, slots[sample_rows], step_prompt_logprobs)
        if len(sample_rows):
            out = self.sampler.sample(logits, sample_slots)
            self.batch.next_token_dev[sample_slots] = out.sampled
            step.start_readback(out, self.readback)
        timings["sample"] = time.perf_counter() - start
        if prev is not None:
            prev.output()
        self._pending = step
        return step

    def _cpu_threads(self) -> StepThreads:
        """Per-step CPU thread count (see tokenmill/cpu_threads.py); made on first use."""
        if self._step_threads is None:
            arch = self.config.model.arch
            self._step_threads = StepThreads(self.dtype, arch.hidden_size, arch.intermediate_size)
        return self._step_threads
