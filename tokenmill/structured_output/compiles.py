"""Grammar compilation off the caller's thread: one future per grammar text, within a time limit.

The backend is made on the pool's thread too (importing the grammar library and reading the
vocabulary take seconds), on the first grammar. Results (compiled grammars and refusals alike)
are kept per text in an LRU of `max_entries`, so a schema sent again costs nothing; a compile
that overran the limit stays in the table and is served once it ends.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from tokenmill.structured_output.backend import GrammarBackend
from tokenmill.structured_output.grammar_spec import GrammarSpec


class GrammarCompiles:
    def __init__(self, make_backend: Callable[[], GrammarBackend], timeout_s: float, threads: int = 2,
                 max_entries: int = 1024, on_compiled: Callable[[float], None] | None = None) -> None:
        """`on_compiled(seconds)`: called (on a pool thread) after each compile, for metrics."""
        self._make_backend = make_backend
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._backend: Future[GrammarBackend] | None = None
        self._entries: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._max_entries = max_entries
        self._on_compiled = on_compiled
        self.num_compiled = 0
        self.compile_seconds = 0.0

    def backend(self) -> Future[GrammarBackend]:
        with self._lock:
            if self._backend is None:
                self._backend = self._pool.submit(self._make_backend)
            return self._backend

    def submit(self, spec: GrammarSpec) -> Future:
        """The compiled grammar of `spec` (a ValueError naming the field if the library refuses it)."""
        backend = self.backend()
        with self._lock:
            future = self._entries.get(spec)
            if future is not None:
                self._entries.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, backend, spec)
            self._entries[spec] = future
            if len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
            return future

    def _compile(self, backend: Future[GrammarBackend], spec: GrammarSpec) -> Any:
        start = time.perf_counter()
        try:
            return backend.result().compile(spec)
        finally:
            seconds = time.perf_counter() - start
            self.num_compiled += 1
            self.compile_seconds += seconds
            if self._on_compiled is not None:
                self._on_compiled(seconds)

    def check(self, spec: GrammarSpec) -> Any:
        """Wait (at most the time limit, once the backend exists) for `spec`'s grammar; ValueError if
        refused or late. Making the backend (once per process) is not held against a request."""
        self.backend().result()
        try:
            return self.submit(spec).result(timeout=self.timeout_s)
        except FutureTimeout:
            raise self._late(spec) from None

    async def check_async(self, spec: GrammarSpec) -> Any:
        """`check` without blocking the event loop."""
        await asyncio.wrap_future(self.backend())
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.submit(spec))), self.timeout_s)
        except asyncio.TimeoutError:
            raise self._late(spec) from None

    def _late(self, spec: GrammarSpec) -> ValueError:
        field = "json" if spec.kind == "json_object" else spec.kind
        return ValueError(f"structured_outputs.{field}: the grammar did not compile within {self.timeout_s:g} s "
                          f"(--structured-outputs-compile-timeout)")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
