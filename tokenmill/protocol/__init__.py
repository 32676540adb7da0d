"""Every message that crosses a process boundary, as msgspec Structs.

Conventions: structs are `array_like` (no field names on the wire) and
`omit_defaults`; token id lists travel as packed little-endian int32 bytes
(`pack_ids` / `unpack_ids`); requests are named inside the engine by small
integer handles that the front-end assigns. Nothing here is ever pickled.
"""

from __future__ import annotations

import functools
from enum import IntEnum

import msgspec
import numpy as np

from tokenmill.config import EngineConfig
from tokenmill.sampling_params import SamplingParams

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


def pack_ids(ids) -> bytes:
    return np.asarray(ids, dtype=_I32).tobytes()


def unpack_ids(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype=_I32).tolist()


class FinishReason(IntEnum):
    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the client or the engine
    ERROR = 3  # this request alone failed in a step (see RowFailure); the rest of the batch goes on

    def __str__(self) -> str:
        return self.name.lower()


class RowFailure(IntEnum):
    """Why one request's row of a step failed while the rest of the batch went on."""

    NON_FINITE_LOGITS = 1  # the model produced NaN or infinite logits for the row
    SAMPLING_ERROR = 2  # sampling the row raised (the worker logs the exception)
    GRAMMAR = 3  # structured outputs: the request's grammar failed in the engine core

    @property
    def message(self) -> str:
        """What the request's caller is told (no internals)."""
        if self == RowFailure.NON_FINITE_LOGITS:
            return "the model produced non-finite logits (NaN or infinity) for this request"
        if self == RowFailure.GRAMMAR:
            return "the structured output's grammar failed in the engine"
        return "sampling failed for this request"


# ---------------------------------------------------------------- front-end <-> engine core


class LoRARef(msgspec.Struct, array_like=True, frozen=True):
    """A LoRA adapter as the engine knows it: its id (>= 1; the prefix cache and the slot table
    key on it), its name and its PEFT folder (read by the workers)."""

    id: int
    name: str
    path: str


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    handle: int
    prompt_token_ids: bytes  # packed int32
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    lora: LoRARef | None = None  # the adapter the request runs with; None: the base model


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
    failure: RowFailure | None = None  # set with finish_reason ERROR


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's news for the front-end. A request whose only news is one new token (a steady
    decode) travels in the two packed columns; anything more (a finish, logprobs, a prefix-cache
    hit not yet reported, several tokens) as an `EngineCoreOutput` in `outputs`. A request
    appears at most once per step, in one of the two."""

    outputs: list[EngineCoreOutput]
    timestamp: float = 0.0
    token_handles: bytes = b""  # int32: requests that got exactly one new token and nothing else
    token_ids: bytes = b""  # int32: that token, per handle

    def one_token_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(handles, tokens) of the packed one-token part."""
        return np.frombuffer(self.token_handles, _I32), np.frombuffer(self.token_ids, _I32)

    def num_new_tokens(self) -> int:
        return len(self.token_ids) // 4 + sum(len(o.new_token_ids) for o in self.outputs)

    def is_empty(self) -> bool:
        return not self.outputs and not self.token_handles

    def all_outputs(self) -> list[EngineCoreOutput]:
        """Every request's news as an EngineCoreOutput (tests and slow consumers)."""
        handles, tokens = self.one_token_rows()
        return self.outputs + [EngineCoreOutput(h, [t]) for h, t in zip(handles.tolist(), tokens.tolist())]


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
    lora_slot: int = -1  # the device slot of the request's LoRA adapter; -1: none
    # Positions before this one already had their prompt logprobs emitted (before a preemption):
    # the recomputation must not emit them again.
    prompt_logprobs_from: int = 0


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Columnar diffs for requests the workers already hold: blocks appended to their block tables."""

    handles: bytes = b""  # int32: the requests that got new blocks
    num_new_blocks: bytes = b""  # int32: how many, per handle
    new_block_ids: bytes = b""  # int32: the new blocks of every handle, concatenated in handle order

    @staticmethod
    def pack(handles, num_new_blocks, new_block_ids) -> "CachedRequestData | None":
        """From three int sequences (lists or arrays); None when no request got a block."""
        if not len(handles):
            return None
        return CachedRequestData(pack_ids(handles), pack_ids(num_new_blocks), pack_ids(new_block_ids))

    def rows(self) -> list[tuple[int, list[int]]]:
        """(handle, its new block ids) per request."""
        ids, start, rows = unpack_ids(self.new_block_ids), 0, []
        for handle, count in zip(unpack_ids(self.handles), unpack_ids(self.num_new_blocks)):
            rows.append((handle, ids[start:start + count]))
            start += count
        return rows


class ProposerResume(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the proposer's state (n-gram histories, a draft's KV) is rebuilt from after a dormant
    spell (see core/spec_policy.py): every running request's tokens as the engine core knows
    them, and whether one more token, sampled by a step still in flight, follows them (the
    worker holds it on the device as the row's next input)."""

    handles: bytes  # int32, every request the workers hold
    counts: bytes  # int32, tokens known per handle
    tokens: bytes  # int32, those tokens, concatenated in handle order
    pending: bytes  # int32 0 or 1 per handle: a sampled token in flight follows them

    @staticmethod
    def pack(handles, counts, tokens, pending) -> "ProposerResume":
        return ProposerResume(pack_ids(handles), pack_ids(counts), pack_ids(tokens), pack_ids(pending))

    def rows(self) -> list[tuple[int, np.ndarray, bool]]:
        """(handle, its known tokens, a pending token follows) per request."""
        handles, counts = unpack_ids(self.handles), np.frombuffer(self.counts, _I32)
        tokens, pending = np.frombuffer(self.tokens, _I32), unpack_ids(self.pending)
        ends = np.cumsum(counts)
        return [(h, tokens[end - n:end], bool(p))
                for h, n, end, p in zip(handles, counts.tolist(), ends.tolist(), pending)]


class BatchDiff(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """This step's batch relative to the previous step's (see `tokenmill.protocol.batch_diff`).

    Rows are the previous batch minus `removed_rows`, then `added` handles; or
    `full` when listing the batch is smaller. Every row schedules one token
    unless `count_rows` says otherwise. Steady-state decode is all defaults: 0 bytes.
    """

    count_rows: bytes = b""  # int32 rows whose token count is not 1
    count_values: bytes = b""  # int32 their counts
    removed_rows: bytes = b""  # int32, ascending indices into the previous batch
    added: bytes = b""  # int32 handles appended, in order
    full: bytes | None = None  # int32 handles: the whole batch, replacing the previous one


class LoRALoad(msgspec.Struct, array_like=True, frozen=True):
    """Workers put adapter `lora` into device slot `slot` before the step (from host memory, or
    read from its folder first)."""

    slot: int
    lora: LoRARef


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, dict=True):
    """One step, as the workers need it. Local views, set by BatchOrder on each side from `batch`
    and never on the wire: `batch_handles` / `batch_counts` (int32 arrays: the handle and the
    number of scheduled tokens of each row), `total_num_scheduled_tokens`, and the same two
    columns as lists, `scheduled_handles` / `num_scheduled_tokens` (made on first use)."""

    step_id: int
    batch: BatchDiff | None = None  # None: the previous step's batch, one token per row
    new_requests: list[NewRequestData] = []
    cached_requests: CachedRequestData | None = None
    finished_handles: list[int] = []  # workers drop these before the step
    preempted_handles: list[int] = []  # workers drop these too; they come back as new requests
    digest: int | None = None  # debug mode: crc32 of the scheduler's view (see protocol/digest.py)
    # Speculative decoding: workers propose drafts at the end of this step, for the next. A decode
    # row scheduled for 1 + k tokens verifies k of the drafts proposed for it (the worker tells
    # decode rows from prefill chunks by its own count of the prompt tokens computed).
    propose: bool = False
    # The proposer's state (n-gram histories, a draft's KV): rebuilt from these tokens before the
    # step (proposing resumes), or dropped (`proposer_dormant`: nothing will be proposed for a
    # while, so the workers stop keeping it current: the step is the plain one).
    proposer_resume: ProposerResume | None = None
    proposer_dormant: bool = False
    # Pipeline parallelism only: int32, each row's first input token (the first stage cannot
    # read sampled tokens on its device; see tokenmill/worker/pp_stage.py).
    pp_input_tokens: bytes = b""
    # Structured outputs: some row samples under a grammar; its `GrammarBitmask` follows this step
    # on the ring (once the step before is applied) and the workers apply it before sampling.
    awaits_bitmask: bool = False
    # LoRA: adapters to put into device slots before this step (new requests name their slot),
    # and adapters of newly arrived requests to start reading into host memory in the background.
    lora_loads: list[LoRALoad] = []
    lora_prefetch: list[LoRARef] = []
    # Pipeline device tokens only: before this step the first stage applies the sampled tokens the
    # last stage sent for every step up to this id (rows whose `pp_input_tokens` entry is -1 read
    # theirs from there); 0: none.
    pp_tokens_upto: int = 0

    @functools.cached_property
    def scheduled_handles(self) -> list[int]:
        return self.batch_handles.tolist()

    @functools.cached_property
    def num_scheduled_tokens(self) -> list[int]:
        return self.batch_counts.tolist()


class GrammarBitmask(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A step's token masks for its constrained rows (structured outputs). Distinct masks travel
    once: batch row rows[i] takes mask row which[i] of `bitmask` (int32 [distinct, words],
    XGrammar's layout: bit t % 32 of word t // 32 allows token t); rows of requests in the same
    grammar state (every row inside a JSON string, say) share one. Rows not listed sample unmasked.

    Speculative decoding: a row verifying k drafts samples k + 1 positions; entry i masks position
    positions[i] of row rows[i] (0: the token after the row's known ones; j: after its first j
    drafts too). A row lists positions 0..j, up to its first draft the grammar forbids (position
    j's mask excludes that draft, so verification stops there) or its last; later positions are
    never emitted and sample unmasked."""

    step_id: int
    rows: bytes = b""  # int32 batch rows (a row once per masked position)
    which: bytes = b""  # int32 per entry: its mask among the distinct ones
    words: int = 0
    bitmask: bytes = b""  # int32 [distinct, words]
    positions: bytes = b""  # int32 per entry: the row's position it masks (empty: all 0)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, which, distinct masks [distinct, words])."""
        rows, which = np.frombuffer(self.rows, _I32), np.frombuffer(self.which, _I32)
        bits = np.frombuffer(self.bitmask, _I32)
        return rows, which, bits.reshape(len(bits) // self.words if self.words else 0, self.words)

    def position_array(self) -> np.ndarray:
        """Each entry's position within its row (int32)."""
        if not self.positions:
            return np.zeros(len(self.rows) // 4, _I32)
        return np.frombuffer(self.positions, _I32)


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Sampled tokens per row of the step's batch, packed: 4 bytes per sampled token.

    A row samples one token unless listed in `count_rows` (0 for a partial prefill chunk,
    more with speculative decoding).
    """

    step_id: int
    sampled: bytes = b""  # int32 tokens of every row, concatenated in row order
    count_rows: bytes = b""  # int32 rows whose number of tokens is not 1
    count_values: bytes = b""
    logprobs: list[Logprobs | None] = []
    prompt_logprobs: list[Logprobs | None] = []
    failed_rows: bytes = b""  # int32 rows that failed alone (their sampled token is meaningless)
    failures: bytes = b""  # int32 RowFailure of each failed row
    # Structured outputs with speculative decoding: the drafts proposed at the end of this step
    # (for the next) of its constrained rows, so the engine core can mask each draft position.
    draft_rows: bytes = b""  # int32 batch rows
    drafts: bytes = b""  # int32 [len(draft_rows), K]

    @staticmethod
    def from_rows(step_id: int, rows: list[list[int]], **extra) -> "ModelRunnerOutput":
        odd = [(i, len(r)) for i, r in enumerate(rows) if len(r) != 1]
        return ModelRunnerOutput(step_id=step_id, sampled=pack_ids([t for r in rows for t in r]),
                                 count_rows=pack_ids([i for i, _ in odd]),
                                 count_values=pack_ids([n for _, n in odd]), **extra)

    def row_counts(self, num_rows: int) -> np.ndarray:
        """Tokens sampled per row (int32)."""
        counts = np.ones(num_rows, _I32)
        if self.count_rows:
            counts[np.frombuffer(self.count_rows, _I32)] = np.frombuffer(self.count_values, _I32)
        return counts

    def sampled_tokens(self) -> np.ndarray:
        """Every row's sampled tokens, concatenated in row order (int32)."""
        return np.frombuffer(self.sampled, _I32)

    def draft_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(batch rows, their proposed drafts int32 [rows, K])."""
        rows, drafts = np.frombuffer(self.draft_rows, _I32), np.frombuffer(self.drafts, _I32)
        return rows, drafts.reshape(len(rows), len(drafts) // len(rows) if len(rows) else 0)

    def row_failures(self) -> list[tuple[int, RowFailure]]:
        """(row, why) of each row that failed alone."""
        rows, kinds = np.frombuffer(self.failed_rows, _I32), np.frombuffer(self.failures, _I32)
        return [(row, RowFailure(kind)) for row, kind in zip(rows.tolist(), kinds.tolist())]


# ---------------------------------------------------------------- control messages
#
# Every socket message is multipart: [kind, payload]; `kind` is one byte from the enums
# below and says which struct the payload holds, so each endpoint keeps one decoder per
# type. Messages through the shared-memory ring carry the same kind as their first byte.


class CoreInputKind(IntEnum):
    """Front-end -> engine core."""

    ADD = 1  # EngineCoreRequest
    ABORT = 2  # AbortRequests
    UTILITY = 3  # UtilityCall
    SHUTDOWN = 4  # empty payload


class CoreOutputKind(IntEnum):
    """Engine core -> front-end."""

    OUTPUTS = 1  # EngineCoreOutputs
    UTILITY_RESULT = 2  # UtilityResult
    READY = 3  # EngineCoreReady
    ERROR = 4  # ErrorReport: the core failed (at startup, or later and is exiting)


class WorkerInputKind(IntEnum):
    """Engine core -> workers (through the shared-memory ring)."""

    EXECUTE = 1  # SchedulerOutput
    CALL = 2  # WorkerCall
    SHUTDOWN = 3  # empty payload
    BITMASK = 4  # GrammarBitmask: the masks of the step before it (the worker is waiting for them)


class WorkerOutputKind(IntEnum):
    """Workers -> engine core. Frames: [kind, rank (2 bytes LE), payload]."""

    RESULT = 1  # ModelRunnerOutput (driver rank only)
    CALL_RESULT = 2  # WorkerCallResult (every rank)
    READY = 3  # empty payload: the worker has mapped the ring and connected its sockets
    ERROR = 4  # ErrorReport: the worker failed and is exiting


class UtilityCall(msgspec.Struct, array_like=True):
    """A front-end query answered between steps. `method`: kv_cache_stats | scheduler_stats |
    telemetry_report | reset_telemetry."""

    call_id: int
    method: str


class KVCacheStats(msgspec.Struct, array_like=True, tag="kv"):
    num_free_blocks: int
    num_blocks: int
    num_requests: int  # requests still in the engine core (for leak checks)
    block_bytes: int = 0  # one KV block over the driver rank's layers (MLA: latent + rope key per token)


class SchedulerStats(msgspec.Struct, array_like=True, tag="sched"):
    """The scheduler's counters: what the stats logger prints and `LLM.scheduler_stats()` returns."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # Speculative decoding, since the engine started: verified steps of a request with drafts,
    # draft tokens verified, and accepted (per draft position too: accepted_per_position[j] is how
    # many (j+1)-th drafts were accepted).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []
    num_kv_blocks: int = 0  # the KV pool (set by the engine core)
    weight_bytes: int = 0  # every rank's model weights together, as they sit on the device


class ChannelStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One channel's messages (kind byte + payload) as one side saw them, since the last reset.
    The sender fills `encode_us`, the receiver `decode_us`; `bytes_p50` is over recent messages."""

    count: int = 0
    bytes_total: int = 0
    bytes_last: int = 0
    bytes_max: int = 0
    bytes_p50: int = 0
    encode_us: float = 0.0
    decode_us: float = 0.0


class TimingStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One phase's durations: count and mean since the last reset, p50/p99 over recent samples."""

    count: int = 0
    mean_us: float = 0.0
    p50_us: float = 0.0
    p99_us: float = 0.0
    total_us: float = 0.0


class ProcessTelemetry(msgspec.Struct, array_like=True, omit_defaults=True):
    """One process's message counters and step timings (see `tokenmill.metrics`)."""

    role: str  # frontend | core | worker<rank>
    pid: int
    elapsed_s: float  # since the last reset
    channels: dict[str, ChannelStats] = {}
    timings: dict[str, TimingStats] = {}


class SpecDecodeStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Speculative decoding counters over a window: verified steps of a request with drafts,
    draft tokens verified, accepted, and accepted_per_position[j]: accepted (j+1)-th drafts.
    Derived figures (acceptance rate, mean acceptance length): `tokenmill.metrics.spec_decode`."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = []


class TelemetryReport(msgspec.Struct, array_like=True, tag="telemetry"):
    processes: list[ProcessTelemetry]  # the core first, then each worker rank
    speculation: SpecDecodeStats | None = None  # since the last reset; None without speculation


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: KVCacheStats | SchedulerStats | TelemetryReport | None = None
    error: str | None = None


class EngineCoreReady(msgspec.Struct, array_like=True):
    num_blocks: int
    block_size: int


class ErrorReport(msgspec.Struct, array_like=True, omit_defaults=True):
    """An exception that ends a process, by name, so the receiver can re-raise its kind."""

    exc_type: str
    message: str
    traceback: str = ""


class WorkerCall(msgspec.Struct, array_like=True, omit_defaults=True):
    """A call on every worker. `method`: load_model | available_kv_blocks | kv_block_bytes |
    init_kv_cache (which takes `arg`) | telemetry_snapshot | reset_telemetry | held_requests."""

    method: str
    arg: int | None = None


class WorkerCallResult(msgspec.Struct, array_like=True, omit_defaults=True):
    value: int | ProcessTelemetry | None = None


class CoreLaunch(msgspec.Struct, omit_defaults=True):
    """What the engine-core process is started with (JSON on its command line)."""

    config: EngineConfig  # resolved once by the front-end; the core passes it on to every worker
    run_dir: str  # per-engine temp dir: every socket address and shm name derives from it
    parent_pid: int
    log_level: int = 30
    death_signal: bool = True  # prctl(PR_SET_PDEATHSIG): only when spawned by the main thread


class WorkerLaunch(msgspec.Struct, omit_defaults=True):
    """What a worker process is started with (JSON on its command line)."""

    config: EngineConfig
    rank: int
    ring_name: str
    overflow_addr: str  # where large ring messages arrive (ZMQ PULL, connected)
    reply_addr: str  # the core's PULL socket for replies
    parent_pid: int
    log_level: int = 30
    death_signal: bool = True
    dist_init_method: str = ""  # torch.distributed rendezvous (world_size > 1), e.g. file://... or tcp://...
