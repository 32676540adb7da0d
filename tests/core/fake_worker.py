"""A model-free worker that mirrors request state from SchedulerOutput diffs, as the real one does.

Token at output position p of a request is a fixed function of (prompt, p), so
every schedule must produce the same outputs. It also checks that its mirrored
view (tokens computed, block table) always equals the scheduler's.
"""

from __future__ import annotations

import msgspec

from tokenmill.protocol.batch_diff import BatchOrder
from tokenmill.core.scheduler import Scheduler
from tokenmill.protocol import CachedRequestData, ModelRunnerOutput, SchedulerOutput, unpack_ids

EOS = 3


def next_token(tokens: list[int], num_prompt: int) -> int:
    position = len(tokens) - num_prompt
    seed = (sum(tokens[:num_prompt]) * 31 + position * 17) % 997
    return EOS if seed % 41 == 0 else 10 + seed


class FakeWorker:
    def __init__(self) -> None:
        self.states: dict[int, dict] = {}
        self.batch_order = BatchOrder()

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
                "blocks": unpack_ids(new.block_ids), "computed": new.num_computed_tokens}
        cached = so.cached_requests or CachedRequestData()
        for handle, blocks in zip(cached.handles, cached.new_block_ids):
            self.states[handle]["blocks"].extend(unpack_ids(blocks))
        sampled = []
        for handle, n in zip(so.scheduled_handles, so.num_scheduled_tokens):
            state = self.states[handle]
            state["computed"] += n
            assert state["computed"] <= len(state["tokens"]), "scheduled past the known tokens"
            if state["computed"] == len(state["tokens"]):
                token = next_token(state["tokens"], state["num_prompt"])
                state["tokens"].append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput.from_rows(so.step_id, sampled)

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
