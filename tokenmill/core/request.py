"""The scheduler's view of one request: what it asked for, and its state while it is not running.

While a request runs, its per-step state (token ids, tokens computed, sampled tokens in
flight) lives in a row of the `RunningTable`, so that steady decode is a few numpy
operations over all rows; `token_ids` here is then None. The scheduler moves the state in
when the request is admitted and back out when it is preempted.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from tokenmill.core.block_pool import HashChain
from tokenmill.protocol import FinishReason, LoRARef
from tokenmill.sampling_params import SamplingParams


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class Request:
    def __init__(self, handle: int, prompt_token_ids, params: SamplingParams,
                 eos_token_ids: tuple[int, ...], max_model_len: int, arrival_time: float = 0.0,
                 lora: LoRARef | None = None) -> None:
        """`prompt_token_ids`: a list of ints or an int32 array."""
        self.handle = handle
        self.params = params
        self.arrival_time = arrival_time
        # Prompt followed by outputs; None while running (the RunningTable holds them).
        self.token_ids: np.ndarray | None = np.array(prompt_token_ids, dtype=np.int32)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_pending = 0  # while not running: sampled tokens still in flight (from before a preemption)
        self.slot = -1  # its row in the RunningTable while running
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 until then
        self.cached_tokens_reported = False  # the front-end has heard num_cached_tokens
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_token_id: int | None = None
        self.lora = lora  # the LoRA adapter it runs with (None: the base model)
        # Hash chain over the full blocks of the token ids (seeded by the adapter: see HashChain).
        self.block_hashes: list[int] = HashChain(None if lora is None else hash(("lora", lora.id)))
        self.num_preemptions = 0
        # Prompt positions [0, this) were computed (and their prompt logprobs sent to the workers'
        # outputs) before a preemption; a recomputation emits prompt logprobs only from here on.
        self.prompt_logprobs_from = 0
        self.grammar = None  # structured outputs: its RequestGrammar (core/grammar_masks.py) once compiled
        # Stop conditions, fixed at arrival.
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_ids = self.eos_token_ids | self.stop_token_ids
        room = max_model_len - self.num_prompt_tokens
        self.max_output_tokens = room if params.max_tokens is None else min(params.max_tokens, room)

    @property
    def num_tokens(self) -> int:
        """Only while not running."""
        assert self.token_ids is not None, "a running request's tokens are in the RunningTable"
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def finish_reason_for(self, token_id: int, num_output_tokens: int) -> FinishReason | None:
        """Does `token_id`, the request's `num_output_tokens`-th output, finish it?
        (The same rule, over many rows at once: `stop_rules.finish_reasons`.)"""
        if token_id in self.stop_ids and num_output_tokens > self.params.min_tokens:
            return FinishReason.STOP
        if num_output_tokens >= self.max_output_tokens:
            return FinishReason.LENGTH
        return None
