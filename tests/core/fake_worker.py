"""A model-free worker that mirrors request state from SchedulerOutput diffs, as the real one does.

Token at output position p of a request is a fixed function of (prompt, p), so
every schedule must produce the same outputs. It also checks that its mirrored
view (tokens computed, block table) always equals the scheduler's.
"""

from __future__ import annotations

import msgspec
import numpy as np

from tokenmill.protocol.batch_diff import BatchOrder
from tokenmill.core.scheduler import Scheduler
from tokenmill.protocol import Logprobs, ModelRunnerOutput, SchedulerOutput, unpack_ids

EOS = 3


def next_token(tokens: list[int], num_prompt: int) -> int:
    position = len(tokens) - num_prompt
    seed = (sum(tokens[:num_prompt]) * 31 + position * 17) % 997
    return EOS if seed % 41 == 0 else 10 + seed


def fake_logprobs(token: int, k: int | None) -> Logprobs | None:
    """A made-up logprobs row for a sampled token (when the request asked for any)."""
    if k is None:
        return None
    ids = np.array([[token] + [token + 1 + j for j in range(k)]])
    return Logprobs.from_arrays(ids, -ids.astype(np.float32) / 1000, np.array([1 + token % 3]))


def fake_prompt_logprobs(state: dict, num_scheduled: int) -> Logprobs | None:
    """Made-up logprobs for the prompt positions this chunk predicts (as the real runner)."""
    k = state["params"].prompt_logprobs
    first = max(state["computed"] - num_scheduled, state["prompt_logprobs_from"])  # none twice
    last = min(state["computed"], state["num_prompt"] - 1)
    if k is None or last <= first:
        return None
    targets = np.array(state["tokens"][first + 1:last + 1])[:, None]
    ids = np.concatenate([targets] + [targets + 1 + j for j in range(k)], 1)
    return Logprobs.from_arrays(ids, -ids.astype(np.float32), np.arange(1, len(targets) + 1))


class FakeWorker:
    def __init__(self, accepts=None, block_size: int | None = None) -> None:
        """`accepts(handle, output_position) -> bool`: speculative decoding is on, and whether the
        draft for that position is right (drafts beyond the known tokens are verified: the row
        emits the accepted ones and one more, as the real worker does). `block_size`: check that
        every fed token has a KV slot. As the real worker, it has drafts only for the rows that
        sampled in a step marked `propose`, and only for the step right after it. It keeps the
        n-gram histories as the real worker does (dropped on `proposer_dormant`, rebuilt from
        `proposer_resume`, else recorded each step) and checks them against its own tokens."""
        self.states: dict[int, dict] = {}
        self.histories: dict[int, list[int]] | None = None  # handle -> history, while held
        self.num_resumes = self.num_sleeps = self.num_resumed_in_flight = 0
        self.proposed_at: dict[int, int] = {}  # handle -> the last step at whose end it proposed
        self.batch_order = BatchOrder()
        self.accepts = accepts
        self.block_size = block_size
        self.num_drafts = self.num_accepted = 0
        self.accepted_per_position: list[int] = []  # [j]: (j+1)-th drafts accepted, counted here

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        # Decode from the wire form, as a worker in another process does.
        so = msgspec.msgpack.decode(msgspec.msgpack.encode(so), type=SchedulerOutput)
        self.batch_order.decode(so)
        for handle in so.finished_handles + so.preempted_handles:
            self.states.pop(handle, None)
        for new in so.new_requests:
            assert new.handle not in self.states, "new request already known"
            self.states[new.handle] = {
                "tokens": unpack_ids(new.token_ids), "num_prompt": new.num_prompt_tokens,
                "blocks": unpack_ids(new.block_ids), "computed": new.num_computed_tokens,
                "params": new.sampling_params, "prompt_logprobs_from": new.prompt_logprobs_from}
        for handle, blocks in so.cached_requests.rows() if so.cached_requests else ():
            self.states[handle]["blocks"].extend(blocks)
        self._update_histories(so)
        sampled, logprobs, prompt_logprobs = [], [], []
        for handle, n in zip(so.scheduled_handles, so.num_scheduled_tokens):
            state = self.states[handle]
            drafts = n - (len(state["tokens"]) - state["computed"])
            if self.block_size is not None:
                assert len(state["blocks"]) * self.block_size >= state["computed"] + n, "a fed token has no KV slot"
            if drafts > 0:
                assert self.histories is not None, f"{handle}: drafts verified while the proposer's state is dropped"
                assert self.proposed_at.get(handle) == so.step_id - 1, (
                    f"{handle}: {drafts} drafts scheduled, but nothing was proposed for it in step {so.step_id - 1}")
                sampled.append(self._verify(handle, state, n, drafts))
                logprobs.append(None)
                prompt_logprobs.append(None)
                continue
            state["computed"] += n
            assert state["computed"] <= len(state["tokens"]), "scheduled past the known tokens"
            prompt_logprobs.append(fake_prompt_logprobs(state, n))
            if state["computed"] == len(state["tokens"]):
                token = next_token(state["tokens"], state["num_prompt"])
                state["tokens"].append(token)
                sampled.append([token])
                logprobs.append(fake_logprobs(token, state["params"].logprobs))
            else:
                sampled.append([])
                logprobs.append(None)
        if self.histories is not None:
            for handle, tokens in zip(so.scheduled_handles, sampled):
                self.histories[handle] += tokens
            assert all(self.histories[h] == state["tokens"] for h, state in self.states.items()), "a history diverged"
        if so.propose:
            assert self.histories is not None, "asked to propose without histories"
            for handle, tokens in zip(so.scheduled_handles, sampled):
                if tokens:
                    self.proposed_at[handle] = so.step_id
        return ModelRunnerOutput.from_rows(
            so.step_id, sampled, logprobs=logprobs if any(logprobs) else [],
            prompt_logprobs=prompt_logprobs if any(prompt_logprobs) else [])

    def _update_histories(self, so: SchedulerOutput) -> None:
        """Before the step, as the real worker: drop, rebuild (the core's tokens, then the row's
        next input where a sampled token is in flight: here the last token the worker made),
        or keep (new requests bring their tokens, gone ones are forgotten)."""
        if so.proposer_dormant:
            assert self.histories is not None and not so.propose, "dormant while not holding, or proposing"
            self.histories = None
            self.num_sleeps += 1
        if so.proposer_resume is not None:
            assert self.histories is None, "resume while holding histories"
            self.num_resumes += 1
            self.histories = {}
            for handle, tokens, pending in so.proposer_resume.rows():
                own = self.states[handle]["tokens"]
                self.histories[handle] = tokens.tolist() + own[-1:] * pending
                self.num_resumed_in_flight += pending
                assert self.histories[handle] == own, f"resumed history of {handle} differs from its tokens"
            assert set(self.histories) == set(self.states), "resume does not cover every request held"
        elif self.histories is not None:
            self.histories = {h: self.histories.get(h, list(state["tokens"])) for h, state in self.states.items()}

    def _verify(self, handle: int, state: dict, n: int, drafts: int) -> list[int]:
        """A decode row with `drafts` drafts: the accepted ones, then the target's next token (past
        an EOS too: the scheduler must cut there)."""
        assert self.accepts is not None, "drafts scheduled without speculative decoding"
        tokens, num_prompt = state["tokens"], state["num_prompt"]
        accepted = 0
        while accepted < drafts and self.accepts(handle, len(tokens) - num_prompt + accepted):
            accepted += 1
        state["computed"] += n - drafts + accepted
        emitted = []
        for _ in range(accepted + 1):
            emitted.append(next_token(tokens, num_prompt))
            tokens.append(emitted[-1])
        self.num_drafts += drafts
        self.num_accepted += accepted
        self.accepted_per_position += [0] * (accepted - len(self.accepted_per_position))
        for j in range(accepted):
            self.accepted_per_position[j] += 1
        return emitted

    def check_mirrors(self, scheduler: Scheduler, block_size: int) -> None:
        for handle, state in self.states.items():
            request = scheduler.requests.get(handle)
            if request is None:
                continue  # finished; its handle reaches us with the next step
            blocks = scheduler.kv.blocks.get(handle)
            if blocks is None:
                continue  # preempted; dropped with the next step
            assert state["blocks"] == blocks, f"block table of {handle} diverged"
            assert len(blocks) * block_size >= state["computed"]


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens:
        token = next_token(tokens, len(prompt))
        tokens.append(token)
        if token == EOS:
            break
    return tokens[len(prompt):]
