"""The null model (`load_format="null"`): random tokens, no weights, no KV cache.

It keeps the same per-request mirror as the real runner (from the same diffs) and
samples one random token for each row that reaches the end of its known tokens, so the
whole multi-process engine can be driven at any batch size to measure its own overhead.
"""

from __future__ import annotations

import time

import numpy as np

from tokenmill.config import EngineConfig
from tokenmill.protocol.batch_diff import BatchOrder
from tokenmill.worker.step_diffs import apply_step_diffs
from tokenmill.protocol import ModelRunnerOutput, NewRequestData, SchedulerOutput, pack_ids, unpack_ids

NOMINAL_KV_BLOCKS = 1 << 20


class NullState:
    """A request as the worker mirrors it: token count, tokens computed, block table."""

    __slots__ = ("num_tokens", "num_computed_tokens", "block_ids")

    def __init__(self, num_tokens: int, num_computed_tokens: int, block_ids: list[int]) -> None:
        self.num_tokens = num_tokens
        self.num_computed_tokens = num_computed_tokens
        self.block_ids = block_ids


class NullStep:
    """A launched step whose output is already known (the runner's `PendingStep` interface)."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def done(self) -> bool:
        return True

    def output(self) -> ModelRunnerOutput:
        return self._output


class NullRunner:
    model = None  # no forward pass to watch

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.states: dict[int, NullState] = {}
        self.batch_order = BatchOrder()
        self.last_timings: dict[str, float] = {}
        self._vocab_size = config.model.vocab_size
        self._rng = np.random.default_rng(config.model.seed)

    def load_model(self) -> None:
        pass

    def kv_block_bytes(self) -> int:
        return 0

    def available_kv_blocks(self) -> int:
        return self.config.cache.num_blocks_override or NOMINAL_KV_BLOCKS

    def init_kv_cache(self, num_blocks: int) -> None:
        pass

    def launch(self, so: SchedulerOutput) -> NullStep:
        start = time.perf_counter()
        self._apply_diffs(so)
        idle_rows = []
        num_sampled = 0
        for row, (handle, n) in enumerate(zip(so.scheduled_handles, so.num_scheduled_tokens)):
            state = self.states[handle]
            state.num_computed_tokens += n
            if state.num_computed_tokens >= state.num_tokens:
                state.num_tokens += 1
                num_sampled += 1
            else:
                idle_rows.append(row)  # a prefill chunk short of the prompt's end: no token
        prepared = time.perf_counter()
        tokens = self._rng.integers(0, self._vocab_size, num_sampled, dtype=np.int32)
        output = ModelRunnerOutput(step_id=so.step_id, sampled=tokens.astype("<i4").tobytes(),
                                   count_rows=pack_ids(idle_rows), count_values=pack_ids([0] * len(idle_rows)))
        self.last_timings = {"prepare": prepared - start, "forward": 0.0,
                             "sample": time.perf_counter() - prepared}
        return NullStep(output)

    def _apply_diffs(self, so: SchedulerOutput) -> None:
        apply_step_diffs(so, self.batch_order, self)

    def mirror_view(self, handle: int) -> tuple[int, list[int]] | None:
        state = self.states.get(handle)
        return None if state is None else (state.num_computed_tokens, state.block_ids)

    # RequestMirror
    def drop(self, handle: int) -> None:
        self.states.pop(handle, None)

    def add(self, data: NewRequestData) -> None:
        self.states[data.handle] = NullState(len(data.token_ids) // 4, data.num_computed_tokens,
                                             unpack_ids(data.block_ids))

    def append_blocks(self, handle: int, block_ids: np.ndarray) -> None:
        self.states[handle].block_ids.extend(block_ids.tolist())
