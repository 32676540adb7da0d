"""A launched step whose sampled ids are still on their way to the host, and prompt logprobs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.protocol import Logprobs, ModelRunnerOutput
from tokenmill.worker.row_faults import split_failures

if TYPE_CHECKING:
    from tokenmill.layers.sampling import SamplerOutput
    from tokenmill.worker.model_runner import ModelRunner

_I32 = np.dtype("<i4")


class PendingStep:
    """`output()` waits for the step's read-back and returns the reply (built once)."""

    def __init__(self, runner: ModelRunner | None, step_id: int, num_rows: int, sample_rows: np.ndarray,
                 sample_slots: np.ndarray, prompt_logprobs: list[Logprobs | None]) -> None:
        self.step_id = step_id
        self.num_rows = num_rows
        self.sample_rows = sample_rows
        self.prompt_logprobs = prompt_logprobs
        self.on_host = False
        self._ticket = None
        # (index among sampling rows, k) of rows that asked for logprobs, fixed at launch:
        # their slots may be reused before the reply is read.
        self._logprob_rows: list[tuple[int, int]] = []
        if runner is not None and runner.sampling.plan.logprobs is not None:
            params = runner.batch.params
            self._logprob_rows = [(i, params[slot].logprobs) for i, slot in enumerate(sample_slots.tolist())
                                  if params[slot].logprobs is not None]
        self._output: ModelRunnerOutput | None = None
        self._speculative = False
        self._packed = False  # a speculative read-back of one packed tensor (start_packed_readback)
        self._runner = runner
        self._draft_rows: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # (index, slot, drafts)
        self._handles = np.zeros(0, dtype=np.int64)
        self._drafts: tuple[np.ndarray, object] | None = None  # (batch rows, ticket): constrained rows' drafts

    @classmethod
    def empty(cls, step_id: int) -> PendingStep:
        return cls(None, step_id, 0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), [])

    def start_readback(self, out: SamplerOutput, readback) -> None:
        tensors = [out.sampled]
        if out.logprobs is not None and self._logprob_rows:
            lp = out.logprobs
            tensors += [lp.sampled_logprobs, lp.sampled_ranks, lp.topk_token_ids, lp.topk_logprobs]
        self._ticket = readback.start(tensors)

    def start_speculative_readback(self, emitted: torch.Tensor, num_emitted: torch.Tensor | None, readback,
                                   sample_slots: np.ndarray, sample_drafts: np.ndarray,
                                   logprobs: list[torch.Tensor] | None = None) -> None:
        """A step whose sampling rows emitted 1..1+k tokens each (int64 [S, K+1] and [S]). Once
        read, rows that verified drafts take the rejected ones off the host's computed count."""
        self._speculative = True
        drafted = np.flatnonzero(sample_drafts)
        self._draft_rows = (drafted, sample_slots[drafted], sample_drafts[drafted])
        self._handles = self._runner.batch.handle_of[sample_slots[drafted]]
        extra = logprobs if logprobs is not None and self._logprob_rows else []
        self._packed = num_emitted is None
        self._ticket = readback.start([emitted, *extra] if self._packed else [emitted, num_emitted, *extra])

    def start_packed_readback(self, packed: torch.Tensor, readback, sample_slots: np.ndarray,
                              sample_drafts: np.ndarray) -> None:
        """`start_speculative_readback` of a greedy step-end graph's result: int64 [S, K + 2], each
        row's emitted tokens then its emitted count (one copy)."""
        self.start_speculative_readback(packed, None, readback, sample_slots, sample_drafts)

    def start_drafts_readback(self, rows: np.ndarray, drafts: torch.Tensor, readback) -> None:
        """The drafts proposed at the end of this step for these batch rows (int64 [rows, K]), sent
        with the reply (structured outputs: the core masks each draft position of the next step)."""
        self._drafts = (rows, readback.start([drafts]))

    def done(self) -> bool:
        """True when `output()` will not wait for the device."""
        return ((self._ticket is None or self._ticket.ready())
                and (self._drafts is None or self._drafts[1].ready()))

    def output(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        counts = np.zeros(self.num_rows, dtype=np.int64)
        counts[self.sample_rows] = 1
        sampled = failed_rows = failures = b""
        logprobs: list[Logprobs | None] = []
        if self._ticket is not None:
            host = self._ticket.wait()
            tokens = host[0].numpy()
            if self._speculative:
                if self._packed:
                    emitted, num_emitted = tokens[:, :-1], tokens[:, -1]
                else:
                    emitted, num_emitted = tokens, host[1].numpy()
                num_emitted, failed_rows, failures = split_failures(num_emitted, self.sample_rows, healthy=1)
                counts[self.sample_rows] = num_emitted
                keep = np.arange(emitted.shape[1])[None, :] < num_emitted[:, None]
                sampled = emitted[keep].astype(_I32).tobytes()
                self._correct_host_counts(num_emitted)
                extra = host[1:] if self._packed else host[2:]
                if extra:
                    logprobs = self._pack_logprobs(emitted[:, 0], *(t.numpy() for t in extra))
            else:
                tokens, failed_rows, failures = split_failures(tokens, self.sample_rows)
                sampled = tokens.astype(_I32).tobytes()
            if len(host) > 1 and not self._speculative:
                logprobs = self._pack_logprobs(tokens, *(t.numpy() for t in host[1:]))
        draft_rows = drafts = b""
        if self._drafts is not None:
            rows, ticket = self._drafts
            draft_rows, drafts = rows.astype(_I32).tobytes(), ticket.wait()[0].numpy().astype(_I32).tobytes()
            self._drafts = None
        odd = np.flatnonzero(counts != 1)
        self.on_host = True
        self._output = ModelRunnerOutput(
            step_id=self.step_id, sampled=sampled, count_rows=odd.astype(_I32).tobytes(),
            count_values=counts[odd].astype(_I32).tobytes(), logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs, failed_rows=failed_rows, failures=failures,
            draft_rows=draft_rows, drafts=drafts)
        self._ticket = None
        return self._output

    def _correct_host_counts(self, num_emitted: np.ndarray) -> None:
        """The host counted every draft as computed: take back the rejected ones (for requests
        still in the slot they had at launch)."""
        index, slots, drafts = self._draft_rows
        batch = self._runner.batch
        still = batch.handle_of[slots] == self._handles
        batch.num_computed[slots[still]] -= (drafts + 1 - num_emitted[index])[still]

    def _pack_logprobs(self, tokens, sampled_lp, ranks, top_ids, top_lp) -> list[Logprobs | None]:
        """Per row: column 0 is the sampled token, then the row's own top-k."""
        packed: list[Logprobs | None] = [None] * self.num_rows
        for i, k in self._logprob_rows:
            ids = np.concatenate([[tokens[i]], top_ids[i, :k]])[None, :]
            values = np.concatenate([[sampled_lp[i]], top_lp[i, :k]])[None, :]
            packed[int(self.sample_rows[i])] = Logprobs.from_arrays(ids, values, ranks[i:i + 1])
        return packed


def prompt_logprobs(runner: ModelRunner, slots: np.ndarray, counts: np.ndarray, hidden: torch.Tensor,
                    meta: AttentionMetadata) -> list[Logprobs | None]:
    """For rows that asked: the logprob of each prompt token this chunk predicts, plus the top-k.
    Runs only in steps where some request wants prompt logprobs (it reads back to the host)."""
    batch = runner.batch
    result: list[Logprobs | None] = []
    starts = meta.query_start_loc_cpu.tolist()
    for row, (slot, n) in enumerate(zip(slots.tolist(), counts.tolist())):
        params = batch.params[slot]
        k = params.prompt_logprobs
        computed = int(batch.num_computed[slot])  # after this step
        start = computed - n  # position of this chunk's first token
        # Positions emitted before a preemption are not emitted again by their recomputation.
        first = max(start, int(batch.prompt_logprobs_from[slot]))
        last = min(computed, int(batch.num_prompt[slot]) - 1)  # exclusive
        if k is None or last <= first:
            result.append(None)
            continue
        rows = hidden[starts[row] + first - start:starts[row] + last - start]
        logprobs = torch.log_softmax(runner.model.compute_logits(rows), dim=-1)
        targets = torch.as_tensor(batch.tokens[slot][first + 1:last + 1], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])
        ranks = (logprobs > chosen).sum(-1) + 1
        top = logprobs.topk(k, dim=-1) if k > 0 else None
        ids = targets[:, None] if top is None else torch.cat([targets[:, None], top.indices], 1)
        values = chosen if top is None else torch.cat([chosen, top.values], 1)
        result.append(Logprobs.from_arrays(ids.cpu().numpy(), values.cpu().numpy(), ranks.cpu().numpy()))
    return result if any(r is not None for r in result) else []
