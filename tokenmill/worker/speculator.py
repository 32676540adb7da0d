"""The worker's side of speculative decoding: per-slot draft tokens on the device, proposed at the
end of each step the scheduler marks `propose`, and verified by the next step.

Per slot (device): `drafts` [K] (the proposal for the slot's next step) and, for the n-gram
proposer, the slot's token history (prompt and every emitted token) with its length. The
proposer's state is held only while the scheduler asks for proposals (`live`; see "Dormant
proposer state" in core/spec_policy.py): `resume` rebuilds every request's history from the
tokens the step carries (plus the row's next input, when a sampled token is still in flight),
`sleep` drops them all, and while dormant nothing is recorded. A slot is live while its history
length is non-zero: `add` sets it (a prompt has at least one token), `release` clears it when
the request leaves the worker (all three written by the step's `flush`), so a freed slot holds
nothing. A decode row scheduled for 1 + k tokens feeds its next token then
drafts[:k]; the sampler samples every one of those positions and `verify_drafts` keeps the
matching prefix plus one (see layers/sampling/spec_verify.py). Nothing here waits for the host:
the host learns how many tokens each row emitted when the step's ids are read back.

A draft-model proposer keeps its own KV cache in the same block tables (see draft_proposer.py).
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.config import SpeculativeConfig
from tokenmill.worker.graph_capture import capture_per_size, replay_over_rows
from tokenmill.worker.ngram_proposer import propose_ngram
from tokenmill.worker.persistent_batch import to_device


class Speculator:
    def __init__(self, config: SpeculativeConfig, num_slots: int, max_model_len: int, next_token: torch.Tensor) -> None:
        """`next_token`: each slot's next input on the device (the persistent batch's)."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.next_token = next_token
        self.device = device = next_token.device
        self.keeps_histories = config.method == "ngram"  # a draft model keeps its KV instead
        self.live = False  # the proposer's state is held (and kept current every step); set by `resume`
        self.slept = False  # it has been dropped once (a draft's KV of cached blocks may have holes)
        self.drafts = torch.zeros((num_slots, max(self.k, 1)), dtype=torch.int64, device=device)
        self.history = torch.zeros((num_slots, max_model_len + self.k + 1), dtype=torch.int32, device=device)
        self.history_len = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.draft_model = None  # set by the runner for method draft_model
        self._ones = torch.ones(num_slots, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}  # padded rows -> captured proposer (CUDA)
        self._graph_slots: torch.Tensor | None = None
        # slot -> its history as of this step: a new request's known tokens, or none (released)
        self._added: dict[int, np.ndarray] = {}
        self._pending: list[int] = []  # slots whose next input follows their added tokens (resume)

    def add(self, slot: int, tokens: list[int] | np.ndarray) -> None:
        """A new request (or one back from preemption) in `slot`, with its known tokens; written
        to the device by the step's `flush` (one copy for all of a step's new requests)."""
        if self.recording:
            self._added[slot] = np.array(tokens, dtype=np.int64)  # a later add to the slot replaces it

    @property
    def recording(self) -> bool:
        """Whether each step's emitted tokens go into the histories."""
        return self.live and self.keeps_histories

    def resume(self, rows: list[tuple[int, np.ndarray, bool]]) -> None:
        """Hold the state again: (slot, known tokens, whether the slot's next input follows them)
        for every request the worker holds (the histories from them; a draft's KV is the caller's)."""
        assert not self.live
        self.live = True
        for slot, tokens, pending in rows:
            self.add(slot, tokens)
            if pending and self.keeps_histories:
                self._pending.append(slot)

    def sleep(self) -> None:
        """Drop every history and record nothing until `resume` (no drafts are in flight)."""
        self.live = False
        self.slept = True
        self._added.clear()
        self.history_len.zero_()

    def flush(self) -> None:
        if self._added:
            self._write_added()
        if self._pending:  # resumed rows whose last sampled token is still on its way to the host
            pending = to_device(np.array(self._pending, dtype=np.int64), self.device)
            self._pending.clear()
            self.history[pending, self.history_len[pending]] = self.next_token[pending].to(torch.int32)
            self.history_len[pending] += 1

    def _write_added(self) -> None:
        """Every queued history in one host-to-device copy."""
        slots = np.fromiter(self._added.keys(), dtype=np.int64, count=len(self._added))
        lengths = np.array([len(tokens) for tokens in self._added.values()], dtype=np.int64)
        tokens = np.concatenate([*self._added.values(), np.zeros(0, np.int64)])
        rows = np.repeat(slots, lengths)
        columns = np.arange(len(tokens)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        packed = to_device(np.concatenate([slots, lengths, rows, columns, tokens]), self.device)
        n, m = len(slots), len(tokens)
        slots_d, lengths_d = packed[:n], packed[n:2 * n]
        rows_d, columns_d, tokens_d = packed[2 * n:2 * n + m], packed[2 * n + m:2 * n + 2 * m], packed[2 * n + 2 * m:]
        self.history[rows_d, columns_d] = tokens_d.to(torch.int32)
        self.history_len[slots_d] = lengths_d
        self._added.clear()

    def release(self, slot: int) -> None:
        """The slot's request left the worker (finished, aborted or preempted): its history is
        emptied by the step's `flush`, in the same copy as the step's new requests'."""
        self.add(slot, np.zeros(0, dtype=np.int64))  # a later add to the slot replaces it

    def live_slots(self) -> list[int]:
        """Slots holding a request's history as of the last flush (reads the device: for tests
        and debugging)."""
        return self.history_len.nonzero().flatten().tolist()

    def record(self, slots: torch.Tensor, emitted: torch.Tensor, num_emitted: torch.Tensor) -> None:
        """Append each row's emitted tokens (int64 [S, K+1], the first `num_emitted` valid) to its history."""
        if not slots.shape[0]:
            return
        width = emitted.shape[1]
        at = self.history_len.index_select(0, slots)[:, None] + torch.arange(width, device=self.device)[None, :]
        at = at.clamp_max(self.history.shape[1] - 1)
        rows = slots[:, None].expand_as(at)
        keep = torch.arange(width, device=self.device)[None, :] < num_emitted[:, None]
        old = self.history[rows, at]
        self.history[rows, at] = torch.where(keep, emitted.to(torch.int32), old)
        self.history_len.index_add_(0, slots, num_emitted)

    def record_one(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        """`record` for a step that emitted one token per row (no drafts): fewer kernels."""
        if not slots.shape[0]:
            return
        at = self.history_len.index_select(0, slots).clamp_max(self.history.shape[1] - 1)
        self.history[slots, at] = sampled.to(torch.int32)
        self.history_len.index_add_(0, slots, self._ones[:slots.shape[0]])

    def propose(self, slots: torch.Tensor) -> None:
        """Drafts for these slots' next step, from their histories (a graph replay when captured)."""
        if slots.shape[0] and not replay_over_rows(self._graphs, self._graph_slots, slots, self.drafts.shape[0] - 1):
            self._propose(slots)

    def _propose(self, slots: torch.Tensor) -> None:
        c = self.config
        self.drafts[slots] = propose_ngram(self.history, self.history_len, slots, self.k,
                                           c.prompt_lookup_min, c.prompt_lookup_max)

    @torch.inference_mode()
    def capture(self, sizes: list[int], slots: torch.Tensor) -> None:
        """CUDA graphs of the n-gram proposer for batches padded to `sizes` (its ~40 small kernels
        cost more to launch than to run at small batch), reading their rows from `slots` (int64
        [max(sizes)]: the verification graphs' row buffer, padded with the scratch slot, which is
        the last slot here too). A proposal for rows given as a prefix of that buffer copies nothing."""
        assert slots.shape[0] >= max(sizes)
        self._graph_slots = slots
        self._graphs, _ = capture_per_size(sizes, lambda size: self._propose(slots[:size]))
