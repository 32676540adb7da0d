"""Turns a SchedulerOutput into one forward pass and sampled tokens.

Keeps every request's state from the scheduler's diffs (new requests once,
then appended blocks; finished and preempted handles are dropped), builds the
flat attention metadata, runs the model and the sampler.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.cpu_threads import StepThreads
from tokenmill.layers.attention.backend import kv_cache_shape
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.attention.torch_ref import TorchRefAttentionBackend
from tokenmill.layers.sampler import Sampler, build_sampling_metadata
from tokenmill.model.loader import load_model
from tokenmill.protocol.batch_diff import BatchOrder
from tokenmill.protocol import Logprobs, ModelRunnerOutput, SchedulerOutput
from tokenmill.worker.request_state import RequestState
from tokenmill.worker.step_diffs import apply_step_diffs

logger = logging.getLogger(__name__)

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) over the seed space


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device
        self.dtype = config.model.torch_dtype
        self.block_size = config.cache.block_size
        arch = config.model.arch
        self.num_layers = arch.num_layers
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.vocab_size = arch.vocab_size
        self.states: dict[int, RequestState] = {}
        self.batch_order = BatchOrder()
        self._pending: PendingStep | None = None  # the last launched step whose tokens are not on the host
        self.last_timings: dict[str, float] = {}
        self.num_placeholders_filled = 0  # async scheduling inputs taken from the device
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        self.model: torch.nn.Module | None = None

    # ------------------------------------------------------------------ setup

    def load_model(self) -> None:
        m = self.config.model
        start = time.perf_counter()
        self.model = load_model(m.path, m.arch, m.load_format, self.dtype, self.device,
                                TorchRefAttentionBackend, seed=m.seed)
        logger.info("loaded %s in %.1f s", m.path, time.perf_counter() - start)

    def kv_block_bytes(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def available_kv_blocks(self) -> int:
        """How many KV blocks the memory budget allows."""
        if self.config.cache.num_blocks_override:
            return self.config.cache.num_blocks_override
        if self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:
            budget = self.config.cache.cpu_kv_cache_bytes
        return max(budget // self.kv_block_bytes(), 0)

    def _profile_cuda_budget(self) -> int:
        """Run the largest step once and give the KV pool what the utilization target leaves."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.config.scheduler.max_num_batched_tokens, self.config.model.max_model_len)
        blocks = -(-num_tokens // self.block_size)
        self.init_kv_cache(blocks)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        meta = self._metadata([num_tokens], [num_tokens], [list(range(blocks))],
                              np.arange(num_tokens, dtype=np.int64))
        with torch.inference_mode():
            hidden = self.model(ids, positions, self.kv_caches, meta)
            rows = min(self.config.scheduler.max_num_seqs, num_tokens)
            self.model.compute_logits(hidden[:rows]).softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_allocated(self.device)
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak - used_by_others
        logger.info("GPU memory: total %.1f GiB, model peak %.2f GiB, KV budget %.2f GiB",
                    total / 2**30, peak / 2**30, budget / 2**30)
        return budget

    def init_kv_cache(self, num_blocks: int) -> None:
        shape = kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.num_layers)]

    # ------------------------------------------------------------------ step

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> "PendingStep":
        """Start a step; its sampled ids stay on the device until `output()` is asked for.

        Async scheduling: a request scheduled again before its last sampled token reached
        the host has a placeholder input; it is filled on the device from the previous
        step's sampled ids, so step N+1 can start before step N's tokens are read back.
        """
        timings = self.last_timings = {}
        start = time.perf_counter()
        self._apply_diffs(so)
        prev, self._pending = self._pending, None
        if not so.scheduled_handles:
            if prev is not None:
                prev.output()
            return PendingStep(self, so.step_id, 0)
        if prev is not None and self._needs_host_tokens(so):
            prev.output()  # penalties read the previous token on the host
        input_ids, positions, meta, sampling_rows, sample_states = self._prepare(so)
        if prev is not None:
            self._fill_placeholders(so, input_ids, meta, prev)
        timings["prepare"] = time.perf_counter() - start
        start = time.perf_counter()
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        step = PendingStep(self, so.step_id, len(so.scheduled_handles))
        step.prompt_logprobs = self._prompt_logprobs(so, hidden, meta)
        timings["forward"] = time.perf_counter() - start
        start = time.perf_counter()
        if sampling_rows:
            logits_indices = meta.query_start_loc[1:][torch.as_tensor(sampling_rows, device=self.device)] - 1
            logits = self.model.compute_logits(hidden[logits_indices])
            for state in sample_states:
                if state.generator is not None:
                    position = state.num_computed_tokens - state.num_prompt_tokens
                    state.generator.manual_seed((state.params.seed * _SEED_MIX + position) % (1 << 63))
            sampling_meta = build_sampling_metadata(sample_states, self.vocab_size,
                                                    self.config.model.eos_token_ids, self.device)
            out = self.sampler(logits, sampling_meta)
            step.set_sampled(out, sampling_rows, sample_states, [s.handle for s in sample_states])
        timings["sample"] = time.perf_counter() - start
        if prev is not None:
            prev.output()
        self._pending = step
        return step

    def _needs_host_tokens(self, so: SchedulerOutput) -> bool:
        for handle in so.scheduled_handles:
            p = self.states[handle].params
            if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.min_tokens:
                return True
        return False

    def _fill_placeholders(self, so: SchedulerOutput, input_ids: torch.Tensor, meta: AttentionMetadata,
                           prev: "PendingStep") -> None:
        """Copy on the device the previous step's sampled ids into inputs not yet known on the host."""
        if prev.done_on_host:
            return
        dst, src = [], []
        starts = meta.query_start_loc_cpu.tolist()
        for row, handle in enumerate(so.scheduled_handles):
            state = self.states[handle]
            if state.num_computed_tokens > len(state.token_ids):  # the last input is a placeholder
                dst.append(starts[row + 1] - 1)
                src.append(prev.row_of[handle])
        if dst:
            self.num_placeholders_filled += len(dst)
            index = torch.as_tensor(dst, device=self.device)
            input_ids[index] = prev.sampled[torch.as_tensor(src, device=self.device)]

    def _prompt_logprobs(self, so: SchedulerOutput, hidden: torch.Tensor,
                         meta: AttentionMetadata) -> list[Logprobs | None]:
        """For rows that asked: the logprob of each prompt token this chunk predicts, plus the top-k."""
        result: list[Logprobs | None] = []
        starts = meta.query_start_loc_cpu.tolist()
        for row, (handle, n) in enumerate(zip(so.scheduled_handles, so.num_scheduled_tokens)):
            state = self.states[handle]
            k = state.params.prompt_logprobs
            first = state.num_computed_tokens - n  # position of this chunk's first token
            last = min(state.num_computed_tokens, state.num_prompt_tokens - 1)  # exclusive
            if k is None or last <= first:
                result.append(None)
                continue
            rows = hidden[starts[row]:starts[row] + last - first]
            logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
            targets = torch.as_tensor(state.token_ids[first + 1:last + 1], device=logprobs.device)
            chosen = logprobs.gather(1, targets[:, None])
            ranks = (logprobs > chosen).sum(-1) + 1
            top = logprobs.topk(k, dim=-1) if k > 0 else None
            ids = targets[:, None] if top is None else torch.cat([targets[:, None], top.indices], 1)
            values = chosen if top is None else torch.cat([chosen, top.values], 1)
            result.append(Logprobs.from_arrays(ids.cpu().numpy(), values.cpu().numpy(), ranks.cpu().numpy()))
        return result if any(r is not None for r in result) else []

    def _apply_diffs(self, so: SchedulerOutput) -> None:
        apply_step_diffs(so, self.batch_order, self.states, lambda data: RequestState(data, self.device))

    def _prepare(self, so: SchedulerOutput):
        if self.device.type == "cpu":
            self._cpu_step_threads().apply()
        bs = self.block_size
        input_ids: list[int] = []
        position_chunks, slot_chunks = [], []
        query_lens, seq_lens, block_rows = [], [], []
        sampling_rows: list[int] = []
        sample_states: list[RequestState] = []
        for row, (handle, n) in enumerate(zip(so.scheduled_handles, so.num_scheduled_tokens)):
            state = self.states[handle]
            start = state.num_computed_tokens
            end = start + n
            chunk = state.token_ids[start:end]
            input_ids.extend(chunk)
            if len(chunk) < n:  # async scheduling: the last input is still on the device
                input_ids.extend([0] * (n - len(chunk)))
            positions = np.arange(start, end, dtype=np.int64)
            blocks = np.asarray(state.block_ids, dtype=np.int64)
            position_chunks.append(positions)
            slot_chunks.append(blocks[positions // bs] * bs + positions % bs)
            query_lens.append(n)
            seq_lens.append(end)
            block_rows.append(state.block_ids)
            state.num_computed_tokens = end
            if end >= len(state.token_ids):  # the whole known sequence is computed: sample
                sampling_rows.append(row)
                sample_states.append(state)
        positions = np.concatenate(position_chunks)
        meta = self._metadata(query_lens, seq_lens, block_rows, np.concatenate(slot_chunks))
        ids = torch.as_tensor(input_ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos = torch.from_numpy(positions).to(self.device, non_blocking=True)
        return ids, pos, meta, sampling_rows, sample_states

    def _cpu_step_threads(self) -> StepThreads:
        """Per-step CPU thread count (see tokenmill/cpu_threads.py); made on first use."""
        threads = getattr(self, "_step_threads", None)
        if threads is None:
            arch = self.config.model.arch
            threads = self._step_threads = StepThreads(self.dtype, arch.hidden_size, arch.intermediate_size)
        return threads

    def _metadata(self, query_lens: list[int], seq_lens: list[int], block_rows: list[list[int]],
                  slot_mapping: np.ndarray) -> AttentionMetadata:
        num_seqs = len(query_lens)
        qsl = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        width = max(len(r) for r in block_rows)
        table = np.zeros((num_seqs, width), dtype=np.int32)
        for i, r in enumerate(block_rows):
            table[i, :len(r)] = r
        qsl_cpu = torch.from_numpy(qsl)
        seq_cpu = torch.as_tensor(seq_lens, dtype=torch.int32)
        dev = self.device
        return AttentionMetadata(
            num_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_start_loc=qsl_cpu.to(dev, non_blocking=True), seq_lens=seq_cpu.to(dev, non_blocking=True),
            block_table=torch.from_numpy(table).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev, non_blocking=True),
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_cpu)

    def _pack_logprobs(self, result, sampling_rows, sample_states, num_rows) -> list[Logprobs | None]:
        """Column 0 is the sampled token, then the row's own top-k."""
        sampled_lp = result.sampled_logprobs.cpu().numpy()
        ranks = result.sampled_ranks.cpu().numpy()
        top_ids = result.topk_token_ids.cpu().numpy()
        top_lp = result.topk_logprobs.cpu().numpy()
        packed: list[Logprobs | None] = [None] * num_rows
        for i, (row, state) in enumerate(zip(sampling_rows, sample_states)):
            k = state.params.logprobs
            if k is None:
                continue
            chosen = state.token_ids[-1]
            token_ids = np.concatenate([[chosen], top_ids[i, :k]])[None, :]
            logprobs = np.concatenate([[sampled_lp[i]], top_lp[i, :k]])[None, :]
            packed[row] = Logprobs.from_arrays(token_ids, logprobs, ranks[i:i + 1])
        return packed


class PendingStep:
    """A launched step. `output()` waits for its sampled ids, appends them to the requests'
    host state (once) and returns the reply."""

    def __init__(self, runner: ModelRunner, step_id: int, num_rows: int) -> None:
        self.runner = runner
        self.step_id = step_id
        self.num_rows = num_rows
        self.sampled: torch.Tensor | None = None  # on the device
        self.row_of: dict[int, int] = {}  # handle -> index into `sampled`
        self.prompt_logprobs: list[Logprobs | None] = []
        self.done_on_host = False
        self._host: torch.Tensor | None = None
        self._event = None
        self._sampler_out = None
        self._rows: list[int] = []
        self._states: list[RequestState] = []
        self._output: ModelRunnerOutput | None = None

    def set_sampled(self, out, rows: list[int], states: list[RequestState], handles: list[int]) -> None:
        self.sampled = out.sampled_token_ids
        self.row_of = {h: i for i, h in enumerate(handles)}
        self._sampler_out, self._rows, self._states = out, rows, states
        if self.sampled.device.type == "cuda":
            self._host = torch.empty(self.sampled.shape, dtype=self.sampled.dtype, pin_memory=True)
            self._host.copy_(self.sampled, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = self.sampled

    def done(self) -> bool:
        """True when `output()` will not wait for the device."""
        return self._event is None or self._event.query()

    def output(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        sampled: list[list[int]] = [[] for _ in range(self.num_rows)]
        logprobs: list[Logprobs | None] = []
        if self._host is not None:
            if self._event is not None:
                self._event.synchronize()
            tokens = self._host.tolist()
            for row, state, token in zip(self._rows, self._states, tokens):
                state.token_ids.append(token)
                sampled[row] = [token]
            if self._sampler_out.logprobs is not None:
                logprobs = self.runner._pack_logprobs(self._sampler_out.logprobs, self._rows, self._states,
                                                      self.num_rows)
        self.done_on_host = True
        self._output = ModelRunnerOutput.from_rows(self.step_id, sampled, logprobs=logprobs,
                                                   prompt_logprobs=self.prompt_logprobs)
        self._sampler_out = None
        return self._output
