"""The null model (`load_format="null"`): random tokens, no weights, no KV cache.

It keeps the same per-request mirror as the real runner (from the same diffs) and
samples one random token for each row that reaches the end of its known tokens, so the
whole multi-process engine can be driven at any batch size to measure its own overhead.

The token counts of the requests in the current batch live in numpy arrays in row order
(`_BatchRows`), so a steady step is a few array operations; a request's `NullState` holds
them only while it is out of the batch (and always holds its block table).
"""

from __future__ import annotations

import time

import numpy as np

from tokenmill.config import EngineConfig
from tokenmill.protocol import ModelRunnerOutput, NewRequestData, SchedulerOutput, unpack_ids
from tokenmill.protocol.batch_diff import BatchOrder
from tokenmill.worker.step_diffs import apply_step_diffs

NOMINAL_KV_BLOCKS = 1 << 20
_I32 = np.dtype("<i4")


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


class _BatchRows:
    """Token counts of the batch's requests, in row order (the batch is `BatchOrder.handles`)."""

    def __init__(self) -> None:
        self.num_tokens = np.empty(0, np.int64)
        self.num_computed = np.empty(0, np.int64)

    def stash(self, handles: np.ndarray, rows: np.ndarray, states: dict[int, NullState]) -> None:
        """Write these rows' counts back to their requests' states."""
        for handle, num_tokens, num_computed in zip(handles[rows].tolist(), self.num_tokens[rows].tolist(),
                                                    self.num_computed[rows].tolist()):
            state = states[handle]
            state.num_tokens, state.num_computed_tokens = num_tokens, num_computed

    def rebuild(self, kept: np.ndarray, added: np.ndarray, states: dict[int, NullState]) -> None:
        """Keep the rows in `kept` (a mask), then append rows for the `added` handles."""
        joining = [states[h] for h in added.tolist()]
        self.num_tokens = np.concatenate([self.num_tokens[kept], [s.num_tokens for s in joining]]).astype(np.int64)
        self.num_computed = np.concatenate(
            [self.num_computed[kept], [s.num_computed_tokens for s in joining]]).astype(np.int64)


class NullRunner:
    model = None  # no forward pass to watch

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.states: dict[int, NullState] = {}
        self.batch_order = BatchOrder()
        self.last_timings: dict[str, float] = {}
        self._rows = _BatchRows()
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

    def finish_step(self, mask) -> None:
        """Grammar masks (structured outputs) do not apply to random tokens: read and dropped."""

    def launch(self, so: SchedulerOutput) -> NullStep:
        start = time.perf_counter()
        self._apply_diffs(so)
        rows = self._rows
        rows.num_computed += so.batch_counts
        sampling = rows.num_computed >= rows.num_tokens  # the row reached the end of its known tokens
        rows.num_tokens += sampling
        idle_rows = (~sampling).nonzero()[0]  # a prefill chunk short of the prompt's end: no token
        if so.digest is not None:  # the worker checks `states` against the scheduler's view
            rows.stash(so.batch_handles, np.arange(len(so.batch_handles)), self.states)
        prepared = time.perf_counter()
        tokens = self._rng.integers(0, self._vocab_size, len(sampling) - len(idle_rows), dtype=np.int32)
        output = ModelRunnerOutput(step_id=so.step_id, sampled=tokens.astype(_I32, copy=False).tobytes(),
                                   count_rows=idle_rows.astype(_I32).tobytes(),
                                   count_values=bytes(4 * len(idle_rows)))
        self.last_timings = {"prepare": prepared - start, "forward": 0.0,
                             "sample": time.perf_counter() - prepared}
        return NullStep(output)

    def _apply_diffs(self, so: SchedulerOutput) -> None:
        """The step diffs applied to `states` (see `apply_step_diffs`), and to the batch rows: rows
        that leave the batch hand their counts back to their states, joining rows take theirs."""
        diff, previous = so.batch, self.batch_order.handles
        kept = None
        if diff is not None and (diff.full is not None or diff.removed_rows or diff.added):
            kept = np.ones(len(previous), bool)
            if diff.full is None:
                kept[np.frombuffer(diff.removed_rows, _I32)] = False
            else:
                kept[:] = False
            self._rows.stash(previous, (~kept).nonzero()[0], self.states)
        apply_step_diffs(so, self.batch_order, self)
        if kept is not None:
            self._rows.rebuild(kept, so.batch_handles[kept.sum():], self.states)

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
