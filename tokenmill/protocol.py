"""Every message that crosses a process boundary, as msgspec Structs.

Conventions: structs are `array_like` (no field names on the wire) and
`omit_defaults`; token id lists travel as packed little-endian int32 bytes
(`pack_ids` / `unpack_ids`); requests are named inside the engine by small
integer handles that the front-end assigns. Nothing here is ever pickled.
"""

from __future__ import annotations

from enum import IntEnum

import msgspec
import numpy as np

from tokenmill.sampling_params import SamplingParams

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


def pack_ids(ids) -> bytes:
    return np.asarray(ids, dtype=_I32).tobytes()


def unpack_ids(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype=_I32).tolist()


def unpack_ids_array(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=_I32)


class FinishReason(IntEnum):
    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the client or the engine

    def __str__(self) -> str:
        return self.name.lower()


# ---------------------------------------------------------------- front-end <-> engine core


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    handle: int
    prompt_token_ids: bytes  # packed int32
    sampling_params: SamplingParams
    arrival_time: float = 0.0


class Logprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Logprobs for `rows` consecutive positions; column 0 is the chosen token, then the top-k."""

    rows: int
    cols: int
    token_ids: bytes  # int32 [rows, cols]
    logprobs: bytes  # float32 [rows, cols]
    ranks: bytes  # int32 [rows]: rank of the chosen token (1 = most likely)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        shape = (self.rows, self.cols)
        return (np.frombuffer(self.token_ids, _I32).reshape(shape),
                np.frombuffer(self.logprobs, _F32).reshape(shape),
                np.frombuffer(self.ranks, _I32))

    @staticmethod
    def from_arrays(token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray) -> "Logprobs":
        rows, cols = token_ids.shape
        return Logprobs(rows, cols, token_ids.astype(_I32).tobytes(),
                        logprobs.astype(_F32).tobytes(), ranks.astype(_I32).tobytes())


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    handle: int
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the stop token that finished the request, if any
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    num_cached_tokens: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    outputs: list[EngineCoreOutput]
    timestamp: float = 0.0


class AbortRequests(msgspec.Struct, array_like=True):
    handles: list[int]


# ---------------------------------------------------------------- engine core -> workers


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """Sent once per request (again after a preemption): everything a worker must remember."""

    handle: int
    token_ids: bytes  # packed int32: prompt, plus tokens generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: bytes  # packed int32
    num_computed_tokens: int  # prefix-cache hit or recompute start


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """Columnar diffs for requests the workers already hold."""

    handles: list[int] = []
    new_block_ids: list[bytes] = []  # packed int32 per handle, appended to its block table


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    step_id: int
    new_requests: list[NewRequestData] = []
    cached_requests: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    # Scheduled requests in batch order and their token counts for this step.
    scheduled_handles: list[int] = []
    num_scheduled_tokens: list[int] = []
    total_num_scheduled_tokens: int = 0
    finished_handles: list[int] = []  # workers drop these before the step
    preempted_handles: list[int] = []  # workers drop these too; they come back as new requests


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Sampled tokens, one list per scheduled handle (empty for a partial prefill chunk)."""

    step_id: int
    sampled_token_ids: list[list[int]]
    logprobs: list[Logprobs | None] = []
    prompt_logprobs: list[Logprobs | None] = []
