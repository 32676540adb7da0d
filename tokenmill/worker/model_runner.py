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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.cpu_threads import StepThreads
from tokenmill.distributed.parallel_state import ParallelContext
from tokenmill.layers.attention.backend import AttentionBackend, kv_cache_shape
from tokenmill.layers.attention.mla import mla_cache_shape
from tokenmill.layers.sampling import Sampler, SamplerOutput, SamplingState
from tokenmill.layers.quantization.methods import linear_methods_summary
from tokenmill.layers.sampling.token_bitmask import apply_bitmask_by_row
from tokenmill.model.loader import load_model, weight_bytes
from tokenmill.protocol import GrammarBitmask, NewRequestData, SchedulerOutput
from tokenmill.protocol.batch_diff import BatchOrder
from tokenmill.worker.decode_graphs import DecodeGraphs, verify_logits_rows
from tokenmill.worker.draft_catch_up import catch_up as draft_catch_up
from tokenmill.worker.draft_verify import verify_step
from tokenmill.worker import sharded_greedy
from tokenmill.worker.greedy_tail import GreedyTail
from tokenmill.worker.pending_step import PendingStep, prompt_logprobs
from tokenmill.worker.mask_entries import mask_entries
from tokenmill.worker.mask_upload import MaskUpload
from tokenmill.worker.persistent_batch import PersistentBatch, to_device
from tokenmill.distributed.pp_tokens import DeviceTokens
from tokenmill.worker.pp_stage import PipelineStage, apply_input_tokens
from tokenmill.worker.prompt_graphs import PromptGraphs
from tokenmill.worker.readback import Readback
from tokenmill.worker import row_faults
from tokenmill.worker.speculator import Speculator
from tokenmill.worker.step_diffs import apply_step_diffs
from tokenmill.worker.step_inputs import build_step_inputs
from tokenmill.worker.graph_families import capture_graph_families
from tokenmill.worker.warmup import profile_and_budget, warm_up_kernels

if TYPE_CHECKING:
    from tokenmill.worker.fault_injection import FaultInjector

logger = logging.getLogger(__name__)


@dataclass
class Forward:
    """A step's forward pass, as the sampling part of `launch` needs it."""

    logits: torch.Tensor | None  # [sampling positions, V]; None when `greedy_result` holds the step's end
    sample_rows: np.ndarray  # batch rows that sample
    sample_slots: torch.Tensor  # their slots, on the device
    num_device_inputs: int  # inputs taken from the device (decode rows), for the async counters
    drafts: np.ndarray | None = None  # per sampling row: drafts it verifies (speculation)
    seq_lens: torch.Tensor | None = None  # per sampling row: context after the step (verification)
    greedy_result: torch.Tensor | None = None  # the greedy step-end graph's packed result
    masked_tail: GreedyTail | None = None  # the greedy step-end graph to replay once the grammar masks came
    prompt_logprobs: list = field(default_factory=list)


@dataclass
class _Deferred:
    """A step whose forward pass is launched and whose sampling waits for its grammar masks."""

    fwd: Forward
    step: PendingStep
    slots: np.ndarray
    propose: bool
    deferred_at: float
    forward_done: object | None  # a CUDA event recorded after the forward pass (None on CPU)


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
        self.vocab_size = config.model.arch.vocab_size
        self.kv_dtype = config.cache.kv_torch_dtype(self.dtype)  # fp8 with kv_cache_dtype fp8*
        self.weight_bytes = 0
        self.block_size = config.cache.block_size
        arch = config.model.arch
        self.stage = stage or PipelineStage(ParallelContext.single(arch))
        layout = self.stage.layout  # this rank's layers and KV heads
        self.num_layers, self.num_kv_heads, self.head_dim = layout.num_kv_layers, layout.num_kv_heads, arch.head_dim
        max_seqs = config.scheduler.max_num_seqs
        self.batch = PersistentBatch(max_seqs, -(-config.model.max_model_len // self.block_size), self.device)
        self.sampling = SamplingState(max_seqs, arch.vocab_size, config.model.eos_token_ids, self.device)
        self.sampler = Sampler(self.sampling)
        self.readback = Readback(self.device)
        spec = config.speculative
        self.speculator = (Speculator(spec, max_seqs + 1, config.model.max_model_len, self.batch.next_token_dev)
                           if spec is not None else None)
        self.batch_order = BatchOrder()
        self.kv_caches: list[torch.Tensor] = []
        self.model: torch.nn.Module | None = None
        self.draft = None  # DraftProposer, for speculative_config method draft_model
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None  # speculation: decode rows with drafts
        # All-greedy steps end in a graph too (argmax, verification, state updates): one per family,
        # and for plain decode a second one that also records the n-gram histories (while held).
        self.graph_tail: GreedyTail | None = None
        self.recording_tail: GreedyTail | None = None
        self.verify_tail: GreedyTail | None = None
        self.prompt_graphs: PromptGraphs | None = None  # steps of one prompt chunk (batch-1 prefill)
        self.draft_graphs: DecodeGraphs | None = None  # a draft model's KV of plain decode steps
        self._catch_up: list[tuple[int, np.ndarray]] = []  # (slot, tokens): draft KV to compute first
        self.on_device_work: Callable[[], None] | None = None  # called as each step's device work starts
        self.last_timings: dict[str, float] = {}
        self.num_placeholders_filled = 0  # decode inputs taken from a step not yet read back (async)
        self._pending: PendingStep | None = None  # the last step whose ids are not on the host yet
        self._slots = np.zeros(0, dtype=np.int64)  # the last step's rows, as slots
        self._step_threads: StepThreads | None = None
        self.faults: FaultInjector | None = None  # tests only (worker/fault_injection.py)
        self._deferred: _Deferred | None = None  # a step waiting for its grammar masks (structured outputs)
        self._mask_upload = MaskUpload(self.device)
        self.last_mask_wait: tuple[float, float, bool | None] | None = None  # (deferred, mask came, device idle)
        # CUDA: (step, forward done, mask came) events of the last masked step, read once done:
        # the device's idle time waiting for that step's masks (`mask_idle`).
        self._idle_events: tuple[int, object, object] | None = None
        self._deferred_tokens: np.ndarray | None = None  # a deferred step's sampling slots (pipeline device tokens)
        self.lora = None  # LoRAManager, with enable_lora (worker/lora_manager.py)

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
                                parallel=self.stage.parallel, quant=m.quantization)
        self.weight_bytes = weight_bytes(self.model)
        logger.info("loaded %s in %.1f s (%s attention, %s): weights %.3f GiB; linears: %s; KV cache %s", m.path,
                    time.perf_counter() - start, self.config.attention_backend, m.dtype, self.weight_bytes / 2**30,
                    linear_methods_summary(self.model), str(self.kv_dtype).replace("torch.", ""))
        if self.device.type == "cpu":
            from tokenmill.layers import cpu_isa
            logger.info(cpu_isa.describe())
        if self.config.lora is not None:
            from tokenmill.worker.lora_manager import LoRAManager
            self.lora = LoRAManager(self.model, self.config.lora, m.arch, self.config.scheduler.max_num_seqs,
                                    self.device, self.dtype)
        spec = self.config.speculative
        if spec is not None and spec.draft is not None:
            from tokenmill.worker.draft_proposer import DraftProposer
            self.draft = DraftProposer(spec.draft, self.device, self.dtype,
                                       attention_backend_class(self.config.attention_backend),
                                       self.config.scheduler.max_num_seqs + 1, spec.num_speculative_tokens)

    def kv_bytes_per_token_per_layer(self) -> int:
        """K and V of this rank's heads (in the KV cache dtype); MLA: the latent and the rope key (one 'head')."""
        mla = self.config.model.arch.mla
        if mla is not None:
            return mla.latent_dim * torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.kv_dtype).element_size()

    def kv_block_bytes(self) -> int:
        target = self.num_layers * self.block_size * self.kv_bytes_per_token_per_layer()
        return target + (self.draft.kv_block_bytes(self.block_size) if self.draft is not None else 0)

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
        if self.lora is not None:
            self.lora.warm_up()
        if not self.config.enforce_eager and self.config.attention_backend == "triton":
            self.capture_graphs()

    def capture_graphs(self) -> None:
        """Every CUDA graph family this runner replays (worker/graph_families.py)."""
        capture_graph_families(self)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        mla = self.config.model.arch.mla
        shape = (mla_cache_shape(num_blocks, self.block_size, mla.latent_dim) if mla is not None
                 else kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim))
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype if mla is not None else self.kv_dtype, device=self.device)
                          for _ in range(self.num_layers)]
        if self.draft is not None:
            self.draft.allocate(lambda blocks, heads, dim: kv_cache_shape(blocks, self.block_size, heads, dim),
                                num_blocks, self.block_size)

    # ------------------------------------------------------------------ RequestMirror

    def add(self, data: NewRequestData) -> None:
        slot = self.batch.add(data)
        if self.lora is not None:
            self.lora.set_row(slot, data.lora_slot)
        tokens = self.batch.tokens[slot]
        self.sampling.add(slot, data.sampling_params, tokens[:data.num_prompt_tokens],
                          tokens[data.num_prompt_tokens:])
        spec = self.speculator
        if spec is not None:
            spec.add(slot, tokens)
            if self.draft is not None and spec.live and spec.slept and data.num_computed_tokens:
                # Cached blocks computed while the draft slept have no draft KV.
                self._catch_up.append((slot, np.asarray(tokens[:data.num_computed_tokens], dtype=np.int64)))

    def drop(self, handle: int) -> None:
        slot = self.batch.remove(handle)
        if slot is not None:
            self.sampling.remove(slot)
            if self.speculator is not None:
                self.speculator.release(slot)

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
        if so.lora_prefetch:
            self.lora.read_ahead(so.lora_prefetch)
        if so.lora_loads:  # after every earlier step, before this one (stream order)
            self.lora.load(so.lora_loads)
        tokens = self.stage.device_tokens(self.device)
        if tokens is not None and tokens.is_first:  # the sampled tokens of earlier steps, device to device
            tokens.apply(so.pp_tokens_upto, self.batch.next_token_dev)
        self.stage.count_placeholders(apply_input_tokens(so, self.batch))
        self.batch.flush()
        self.sampling.flush()
        if self.speculator is not None:
            self._update_proposer(so)
        prev, self._pending = self._pending, None
        if not len(so.batch_handles):
            self._slots = np.zeros(0, dtype=np.int64)
            if prev is not None:
                prev.output()
            return PendingStep.empty(so.step_id)
        if changed or len(self._slots) != len(so.batch_handles):
            self._slots = self.batch.slots(so.batch_handles.tolist())
        slots = self._slots
        if self.faults is not None:
            self.faults.before_forward(self, slots)
        counts = so.batch_counts.astype(np.int64)
        if self.device.type == "cpu":
            self._cpu_threads().apply()
        graphs = self.graphs
        one_token_each = so.batch is None or not so.batch.count_rows
        use_graph = (graphs is not None and one_token_each and graphs.padded_size(len(slots)) is not None
                     and self.batch.all_decode(slots))
        verify_graph = not one_token_each and self._fits_verify_graph(slots, counts)
        prompt_graph = not use_graph and not verify_graph and self._fits_prompt_graph(slots, counts)
        sampling = None if tokens is None else DeviceTokens.sampling_slots(
            self.batch.num_computed, self.batch.num_known, slots, counts)
        timings["prepare"] = time.perf_counter() - start
        start = time.perf_counter()
        if use_graph:
            fwd = self._forward_decode_graph(slots, so.step_id, so.awaits_bitmask)
        elif verify_graph:
            fwd = self._forward_verify_graph(slots, counts, so.awaits_bitmask)
        elif prompt_graph:
            fwd = self._forward_prompt_graph(slots, counts)
        else:
            fwd = self._forward_eager(slots, counts, so.step_id, so.awaits_bitmask)
        if fwd is None:  # a pipeline stage before the last: its output went on to the next
            if tokens is not None:  # the first stage: this step's tokens will come back
                tokens.expect(so.step_id, sampling)
            timings["forward"] = time.perf_counter() - start
            return PendingStep.empty(so.step_id)
        sample_rows = fwd.sample_rows
        timings["forward"] = time.perf_counter() - start
        start = time.perf_counter()
        if prev is not None and not prev.on_host:
            self.num_placeholders_filled += fwd.num_device_inputs
        step = PendingStep(self, so.step_id, len(slots), sample_rows, slots[sample_rows], fwd.prompt_logprobs)
        if so.awaits_bitmask:
            # Structured outputs: sampling waits for the step's grammar masks, which follow the
            # tokens of the step before. Those go out first (the caller sends `prev`'s reply),
            # while the device runs this step's forward pass.
            if prev is not None:
                prev.output()
            self._deferred = _Deferred(fwd, step, slots, so.propose, time.perf_counter(), self._forward_done_event())
            self._deferred_tokens = sampling
            self._pending = step
            return step
        self._sample_step(fwd, step, slots, so.propose, None)
        if tokens is not None:  # the last stage: the tokens just sampled, to the first
            tokens.send(self.batch.next_token_dev, sampling)
        timings["sample"] = time.perf_counter() - start
        if prev is not None:
            prev.output()
        self._pending = step
        return step

    @torch.inference_mode()
    def finish_step(self, mask: GrammarBitmask) -> None:
        """Sample the step `launch` left waiting for its grammar masks (a pipeline stage before
        the last samples nothing: the masks every rank reads are dropped there)."""
        deferred, self._deferred = self._deferred, None
        if deferred is None and not self.stage.is_last:
            self.last_mask_wait = None
            return
        assert deferred is not None and deferred.step.step_id == mask.step_id, "a mask for another step"
        arrived = time.perf_counter()
        # Whether the device had finished the forward pass before the mask came (it waited).
        idle = None if deferred.forward_done is None else bool(deferred.forward_done.query())
        self.last_mask_wait = (deferred.deferred_at, arrived, idle)
        if idle:  # an event now runs at once on the idle device: the gap is the device's wait
            self._idle_events = (mask.step_id, deferred.forward_done, self._forward_done_event())
        self._sample_step(deferred.fwd, deferred.step, deferred.slots, deferred.propose, mask)
        tokens = self.stage.device_tokens(self.device)
        if tokens is not None:
            tokens.send(self.batch.next_token_dev, self._deferred_tokens)
        self.last_timings["sample"] = time.perf_counter() - arrived

    def mask_idle(self) -> tuple[int, float] | None:
        """(step, seconds the device sat idle waiting for its masks) of the last step that waited,
        once its events are done (None before; each step once)."""
        if self._idle_events is None or not self._idle_events[2].query():
            return None
        step_id, done, came = self._idle_events
        self._idle_events = None
        return step_id, done.elapsed_time(came) / 1e3

    def _forward_done_event(self):
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _sample_step(self, fwd: Forward, step: PendingStep, slots: np.ndarray, propose: bool,
                     mask: GrammarBitmask | None) -> None:
        """Sample the step's rows (grammar masks applied first), set their next inputs and start
        the read-back; propose drafts for the next step if asked."""
        sample_rows, sample_slots, drafts = fwd.sample_rows, fwd.sample_slots, fwd.drafts
        masked = None
        if fwd.masked_tail is not None:  # a greedy step: masks, argmax and state updates in one replay
            tail = fwd.masked_tail
            bits, which = mask_entries(self.vocab_size, mask, sample_rows, drafts, tail.graphs.query_len)
            fwd.greedy_result = tail.run_masked(len(slots), self._mask_upload, bits, which)
        elif mask is not None and mask.rows:
            bits, which = mask_entries(self.vocab_size, mask, sample_rows, drafts)
            masked = self._mask_upload(bits, which)
        # A row that fails alone (non-finite logits, sampling raising) fails only its request.
        if fwd.greedy_result is not None:
            if drafts is None:
                step.start_readback(SamplerOutput(fwd.greedy_result, None), self.readback)
            else:
                step.start_packed_readback(fwd.greedy_result, self.readback, slots, drafts)
        elif len(sample_rows) and drafts is not None and drafts.any():
            verify_step(self, fwd.logits, slots[sample_rows], sample_slots, drafts, fwd.seq_lens, step, masked)
        elif len(sample_rows):
            logits = fwd.logits
            non_finite = self._screen(logits, sample_slots)
            if masked is not None:  # after the screen: masked logits are -inf by design
                apply_bitmask_by_row(logits, *masked)
            out, failed = row_faults.sample_rows(self._sample, logits, sample_slots, self.sampling.scratch_slot)
            self.batch.next_token_dev[sample_slots] = out.sampled
            if self.speculator is not None and self.speculator.recording:
                self.speculator.record_one(sample_slots, out.sampled)
            step.start_readback(row_faults.mark_failed(out, non_finite, failed), self.readback)
        if self.speculator is not None and propose and len(sample_rows):
            if self.draft is not None:
                plan = self.sampling.plan
                self.draft.propose(self.sampler, sample_slots, *self.draft_inputs(), keep_probs=plan.any_random,
                                   greedy=plan.plain_greedy)
            else:
                self.speculator.propose(sample_slots)
            if self.sampling.plan.structured:
                self._read_back_constrained_drafts(step, slots, sample_rows, sample_slots)

    def _read_back_constrained_drafts(self, step: PendingStep, slots: np.ndarray, sample_rows: np.ndarray,
                                      sample_slots: torch.Tensor) -> None:
        """The drafts just proposed for the constrained rows, to the host with the step's reply:
        the engine core masks each draft position of the next step from them (core/grammar_masks.py).
        A copy on the read-back stream; nothing waits for it here."""
        params = self.batch.params
        constrained = np.array([params[slot].structured_outputs is not None for slot in slots[sample_rows].tolist()],
                               dtype=bool)
        which = np.flatnonzero(constrained)
        if not len(which):
            return
        index = to_device(which.astype(np.int64), self.device)
        drafts = self.speculator.drafts.index_select(0, sample_slots.index_select(0, index))[:, :self.speculator.k]
        step.start_drafts_readback(sample_rows[which], drafts, self.readback)

    # ------------------------------------------------------------------ forward passes

    def _forward_decode_graph(self, slots: np.ndarray, step_id: int, awaits_mask: bool) -> Forward | None:
        """Every row a one-token decode: one replay (and the greedy tail when it applies: now, or
        its masked twin once the step's grammar masks came)."""
        graphs = self.graphs
        if self.draft_graphs is not None and self.speculator.live:
            self.draft_graphs.run(slots)  # the draft's KV of the step's inputs (before they advance)
        logits = self.stage.run_graph(graphs, slots, self.on_device_work, step_id)
        self.batch.num_computed[slots] += 1
        if logits is None:
            return None
        recording = self.speculator is not None and self.speculator.recording
        tail_graphs = self.recording_tail if recording else self.graph_tail
        fwd = Forward(logits, np.arange(len(slots)), graphs.slots[:len(slots)], len(slots))
        if not self._end_in_tail(fwd, tail_graphs, awaits_mask, len(slots)):
            fwd.logits = graphs.whole_logits(logits)  # (TP: gathered only for steps that sample them)
        return fwd

    def _end_in_tail(self, fwd: Forward, tail: GreedyTail | None, awaits_mask: bool, num_rows: int) -> bool:
        """Whether the step ends in the greedy step-end graph: replayed now, or (a step that
        waits for grammar masks) its masked twin, set for `_sample_step` to replay."""
        if not self._greedy_tail_applies(tail):
            return False
        if not awaits_mask:
            fwd.greedy_result = tail.run(num_rows)
            return True
        if tail.masked_twin is None:
            return False
        fwd.masked_tail = tail.masked_twin
        return True

    def _forward_verify_graph(self, slots: np.ndarray, counts: np.ndarray, awaits_mask: bool) -> Forward:
        """Every row a decode, some verifying drafts: one replay; the logits of the real positions,
        or the greedy tail (`_end_in_tail`) when it applies."""
        if self.on_device_work is not None:
            self.on_device_work()
        graphs, drafts = self.verify_graphs, counts - 1
        padded_logits = graphs.run(slots, drafts)
        self.batch.num_computed[slots] += counts
        fwd = Forward(None, np.arange(len(slots)), graphs.slots[:len(slots)], int(counts.sum()), drafts=drafts)
        if not self._end_in_tail(fwd, self.verify_tail, awaits_mask, len(slots)):
            real = to_device(verify_logits_rows(drafts, graphs.query_len), self.device)
            fwd.logits = padded_logits.index_select(0, real)
            fwd.seq_lens = self.batch.num_computed_dev[fwd.sample_slots]
        return fwd

    def _forward_prompt_graph(self, slots: np.ndarray, counts: np.ndarray) -> Forward:
        """One prompt chunk alone (batch-1 prefill): one replay."""
        if self.on_device_work is not None:
            self.on_device_work()
        slot, n = int(slots[0]), int(counts[0])
        first = int(self.batch.num_computed[slot])
        logits = self.prompt_graphs.run(slot, first, np.asarray(self.batch.tokens[slot][first:first + n]))
        self.batch.num_computed[slot] = first + n
        return Forward(logits, np.flatnonzero(first + n >= self.batch.num_known[slots]), self.prompt_graphs.slot, 0)

    def _forward_eager(self, slots: np.ndarray, counts: np.ndarray, step_id: int,
                       awaits_mask: bool = False) -> Forward | None:
        """Any step: inputs built on the host (`step_inputs.py`), the model run eagerly."""
        # While the proposer sleeps no drafts are in flight (the last ones were read back steps
        # ago, so the host's counts are exact): the plain inputs, as without speculation.
        spec = self.speculator
        inputs = build_step_inputs(self.batch, slots, counts, self.block_size,
                                   spec.drafts if spec is not None and spec.live else None)
        if self.lora is not None:
            self.lora.prepare_eager(np.repeat(slots, counts))
        hidden = self.stage.run(self.model, inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, step_id)
        if hidden is None:
            return None
        if self.draft is not None and self.speculator.live:
            self.draft.mirror(inputs.input_ids, inputs.positions, inputs.meta)
        step_prompt_logprobs = []
        if self.batch.num_prompt_logprobs:
            step_prompt_logprobs = prompt_logprobs(self, slots, counts, hidden, inputs.meta)
        if sharded_greedy.applies(self, inputs.sample_rows, inputs.sample_drafts, awaits_mask):
            result = sharded_greedy.run(self, hidden[inputs.logits_indices], inputs.sample_slots)
            return Forward(None, inputs.sample_rows, inputs.sample_slots, inputs.num_device_inputs,
                           greedy_result=result, prompt_logprobs=step_prompt_logprobs)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return Forward(logits, inputs.sample_rows, inputs.sample_slots, inputs.num_device_inputs,
                       drafts=inputs.sample_drafts, seq_lens=inputs.sample_seq_lens,
                       prompt_logprobs=step_prompt_logprobs)

    def _update_proposer(self, so: SchedulerOutput) -> None:
        """The proposer's state, dropped or rebuilt as the step says (a draft runs over every
        position computed so far), then the step's writes."""
        spec = self.speculator
        if so.proposer_dormant:
            spec.sleep()
        if so.proposer_resume is not None:
            slot_of = self.batch.slot_of
            rows = [(slot_of[handle], tokens, pending) for handle, tokens, pending in so.proposer_resume.rows()]
            spec.resume(rows)
            if self.draft is not None:  # (while dormant no drafts were in flight: the counts are exact)
                self._catch_up = [(slot, tokens[:self.batch.num_computed[slot]]) for slot, tokens, _ in rows]
        spec.flush()
        if self._catch_up:
            draft_catch_up(self.draft.model, self.draft.kv_caches, self.batch, self._catch_up, self.block_size,
                           self.config.scheduler.max_num_batched_tokens)
            self._catch_up = []

    def draft_inputs(self) -> tuple:
        """What the draft proposer reads and writes (persistent tensors; `propose`'s arguments)."""
        b = self.batch
        return (b.next_token_dev, b.num_computed_dev, b.block_table_dev, b.num_blocks_dev, self.block_size,
                self.config.model.max_model_len, self.speculator.drafts)

    def _greedy_tail_applies(self, tail: GreedyTail | None) -> bool:
        """Whether this step may end in the greedy step-end graph: every active request plain
        greedy without logprobs (what `Sampler.sample` would do is then one argmax, after the
        grammar masks of a constrained step), and no test hooks on the sampling path."""
        plan = self.sampling.plan
        return tail is not None and plan.plain_greedy and plan.logprobs is None and self.faults is None

    def _fits_prompt_graph(self, slots: np.ndarray, counts: np.ndarray) -> bool:
        """Whether a step replays a prompt-chunk graph: one row, whose chunk is all host-known
        tokens (a prompt, or a resumed request's known tokens), no prompt logprobs, and a
        captured size with room below max_model_len."""
        graphs = self.prompt_graphs
        if graphs is None or len(slots) != 1 or self.batch.num_prompt_logprobs:
            return False
        slot = slots[0]
        first = int(self.batch.num_computed[slot])
        return (first + int(counts[0]) <= self.batch.num_known[slot]
                and graphs.padded_size(int(counts[0]), first) is not None)

    def _fits_verify_graph(self, slots: np.ndarray, counts: np.ndarray) -> bool:
        """Whether a step of decode rows with drafts replays a verification graph: every row a
        decode of at most 1 + k tokens, and room for k + 1 positions below max_model_len (the
        host's computed counts are upper bounds of the device's)."""
        graphs = self.verify_graphs
        if graphs is None or graphs.padded_size(len(slots)) is None or counts.max() > graphs.query_len:
            return False
        room = self.batch.num_computed[slots] + graphs.query_len <= self.config.model.max_model_len
        return bool(room.all()) and self.batch.all_decode(slots)

    def _screen(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Rows (of `logits`, one slot each) with non-finite logits, zeroed (row_faults.py)."""
        if self.faults is not None:
            self.faults.poison_logits(self, logits, slots)
        return row_faults.screen_logits(logits)

    def _sample(self, logits: torch.Tensor, slots: torch.Tensor, *, offsets: torch.Tensor | None = None,
                record: bool = True):
        if self.faults is not None:
            self.faults.before_sampling(self, slots)
        return self.sampler.sample(logits, slots, offsets=offsets, record=record)

    def _cpu_threads(self) -> StepThreads:
        """Per-step CPU thread count (see tokenmill/cpu_threads.py); made on first use."""
        if self._step_threads is None:
            arch = self.config.model.arch
            self._step_threads = StepThreads(self.dtype, arch.hidden_size, arch.intermediate_size)
        return self._step_threads
