"""The scheduler's view of one request: token ids and how far the KV cache has caught up."""

from __future__ import annotations

from enum import IntEnum

from tokenmill.protocol import FinishReason
from tokenmill.sampling_params import SamplingParams


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class Request:
    """Invariant: `num_computed_tokens <= num_tokens`; the KV cache holds the first
    `num_computed_tokens` of `token_ids` (prompt followed by outputs)."""

    def __init__(self, handle: int, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...], max_model_len: int, arrival_time: float = 0.0) -> None:
        self.handle = handle
        self.params = params
        self.arrival_time = arrival_time
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 until then
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_token_id: int | None = None
        self.block_hashes: list[int] = []  # hash chain over the full blocks of token_ids
        self.num_preemptions = 0
        # Stop conditions, fixed at arrival.
        self.stop_ids = frozenset(() if params.ignore_eos else eos_token_ids) | frozenset(params.stop_token_ids or ())
        room = max_model_len - self.num_prompt_tokens
        self.max_output_tokens = room if params.max_tokens is None else min(params.max_tokens, room)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output(self, token_id: int) -> bool:
        """Append one sampled token; return True when the request is now finished."""
        self.token_ids.append(token_id)
        n = self.num_output_tokens
        if token_id in self.stop_ids and n > self.params.min_tokens:
            self.finish_reason = FinishReason.STOP
            if self.params.stop_token_ids and token_id in self.params.stop_token_ids:
                self.stop_token_id = token_id
            return True
        if n >= self.max_output_tokens:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False
