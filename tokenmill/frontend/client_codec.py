"""The front-end's side of the core's wire: one encoder, one decoder per message type.

Each message is counted in the front-end's telemetry (size with the kind byte, encode or
decode time). Used by one thread at a time: the one that sends and receives for its client.
"""

from __future__ import annotations

import itertools
import time

import msgspec

from tokenmill.metrics.telemetry import Telemetry
from tokenmill.protocol import AbortRequests, EngineCoreOutputs, EngineCoreRequest, UtilityCall, UtilityResult


class ClientCodec:
    def __init__(self, telemetry: Telemetry) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._outputs = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._utility = msgspec.msgpack.Decoder(UtilityResult)
        self._call_ids = itertools.count()
        self._requests_stats = telemetry.channel("requests")
        self._outputs_stats = telemetry.channel("outputs")
        self._calls_stats = telemetry.channel("utility_calls")
        self._results_stats = telemetry.channel("utility_results")

    def request(self, message: EngineCoreRequest | AbortRequests) -> bytes:
        start = time.perf_counter()
        payload = self._encoder.encode(message)
        self._requests_stats.encoded(len(payload) + 1, time.perf_counter() - start)
        return payload

    def utility_call(self, method: str) -> tuple[int, bytes]:
        """A new call id, and the call's payload."""
        call_id = next(self._call_ids)
        start = time.perf_counter()
        payload = self._encoder.encode(UtilityCall(call_id, method))
        self._calls_stats.encoded(len(payload) + 1, time.perf_counter() - start)
        return call_id, payload

    def outputs(self, payload) -> EngineCoreOutputs:
        start = time.perf_counter()
        outputs = self._outputs.decode(payload.buffer)
        self._outputs_stats.decoded(len(payload) + 1, time.perf_counter() - start)
        return outputs

    def utility_result(self, payload) -> UtilityResult:
        start = time.perf_counter()
        result = self._utility.decode(payload.buffer)
        self._results_stats.decoded(len(payload) + 1, time.perf_counter() - start)
        return result


def utility_value(result: UtilityResult):
    """A utility call's return value, or its failure raised here."""
    if result.error is not None:
        raise RuntimeError(f"engine core utility call failed: {result.error}")
    return result.result
