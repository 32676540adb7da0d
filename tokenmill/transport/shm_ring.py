"""A shared-memory broadcast ring: one writer, N readers, one message per fixed-size chunk.

Layout of the segment (a file in /dev/shm, mapped by every process):

    header   magic, num_chunks, chunk_size, num_readers           (64 bytes)
    chunk i  seq u64 | length u32 | pad u32 | read flag per reader | payload[chunk_size]

Message k goes to chunk k % num_chunks. Invariants:
- The writer reuses a chunk only when every reader's flag on it is set (read), so it never
  overwrites an unread message; flags start set.
- The writer fills payload and length, clears the flags, and publishes by storing
  seq = k + 1 with release order. A reader expecting message k waits until an acquire load
  of seq reads k + 1, copies the payload, then sets its own flag with a release store; the
  writer reads the flags with acquire loads. So every payload byte is visible before its seq,
  and a reader is done with a chunk before its flag says so, on any CPU (`atomics.py`).
- A message longer than a chunk goes through a ZMQ PUSH socket per reader instead; its
  chunk carries length == OVERFLOW, telling readers to take the next ZMQ message.

Waiters spin briefly, then sleep with exponential backoff; they check a `should_abort`
callback now and then so a dead peer never leaves them waiting forever.
The writer creates the segment and unlinks it as soon as every reader has mapped it
(`unlink()`), so it vanishes with the last process even after a crash.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable

import zmq

from tokenmill.transport.atomics import SharedAtomics

_MAGIC = 0x544D5247  # "TMRG"
_HEADER = struct.Struct("<IIII")
_HEADER_BYTES = 64
_CHUNK_HEAD = struct.Struct("<QII")  # seq, length, pad
_SEQ = struct.Struct("<Q")
_LENGTH = struct.Struct("<I")
OVERFLOW = 0xFFFFFFFF
SHM_DIR = "/dev/shm"


class RingAbortedError(RuntimeError):
    pass


class _Backoff:
    """Spin for a few hundred polls, then sleep 10 µs doubling to `max_sleep_s` (longer once
    idle for a second, so an idle reader costs ~100 wakeups per second)."""

    def __init__(self, should_abort: Callable[[], bool] | None, max_sleep_s: float = 1e-3,
                 idle_sleep_s: float = 1e-2) -> None:
        self._should_abort = should_abort
        self._max = max_sleep_s
        self._idle = idle_sleep_s
        self._polls = 0
        self._sleep = 1e-5
        self._start = time.monotonic()
        self._next_check = self._start + 0.1

    def wait(self) -> None:
        self._polls += 1
        if self._polls < 200:
            return
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + 0.1
            if self._should_abort is not None and self._should_abort():
                raise RingAbortedError("the ring's peer is gone")
        cap = self._idle if now - self._start > 1.0 else self._max
        self._sleep = min(self._sleep * 2, cap)
        time.sleep(self._sleep)


def _stride(num_readers: int, chunk_size: int) -> int:
    raw = _CHUNK_HEAD.size + num_readers + chunk_size
    return (raw + 63) // 64 * 64


class _Segment:
    """The mapped file and the offsets into it."""

    def __init__(self, path: str, create: bool, num_chunks: int = 0, chunk_size: int = 0,
                 num_readers: int = 0) -> None:
        self.path = path
        if create:
            size = _HEADER_BYTES + num_chunks * _stride(num_readers, chunk_size)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                self.mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            _HEADER.pack_into(self.mm, 0, _MAGIC, num_chunks, chunk_size, num_readers)
        else:
            fd = os.open(path, os.O_RDWR)
            try:
                self.mm = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            magic, num_chunks, chunk_size, num_readers = _HEADER.unpack_from(self.mm, 0)
            if magic != _MAGIC:
                raise ValueError(f"{path} is not a tokenmill ring")
        self.num_chunks, self.chunk_size, self.num_readers = num_chunks, chunk_size, num_readers
        self.stride = _stride(num_readers, chunk_size)
        self.atomics = SharedAtomics(self.mm)

    def chunk(self, k: int) -> int:
        return _HEADER_BYTES + (k % self.num_chunks) * self.stride

    def flags(self, base: int) -> int:
        return base + _CHUNK_HEAD.size

    def payload(self, base: int) -> int:
        return base + _CHUNK_HEAD.size + self.num_readers

    def close(self) -> None:
        self.atomics.release()
        self.mm.close()


class ShmRingWriter:
    def __init__(self, name: str, num_readers: int, overflow_addrs: list[str], ctx: zmq.Context,
                 num_chunks: int = 16, chunk_size: int = 256 * 1024) -> None:
        """Creates /dev/shm/`name` (must not exist) and binds one overflow socket per reader."""
        if len(overflow_addrs) != num_readers:
            raise ValueError("one overflow address per reader")
        self._seg = _Segment(os.path.join(SHM_DIR, name), True, num_chunks, chunk_size, num_readers)
        self._linked = True
        for k in range(num_chunks):  # every chunk starts "read by all"
            flags = self._seg.flags(self._seg.chunk(k))
            self._seg.mm[flags:flags + num_readers] = b"\x01" * num_readers
        self._overflow = []
        for addr in overflow_addrs:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(addr)
            self._overflow.append(sock)
        self._next = 0

    @property
    def name(self) -> str:
        return os.path.basename(self._seg.path)

    def write(self, data: bytes | bytearray | memoryview,
              should_abort: Callable[[], bool] | None = None) -> None:
        seg, mm = self._seg, self._seg.mm
        base = seg.chunk(self._next)
        flags = seg.flags(base)
        backoff = _Backoff(should_abort)
        while not seg.atomics.all_set_acquire(flags, seg.num_readers):
            backoff.wait()
        if len(data) <= seg.chunk_size:
            payload = seg.payload(base)
            mm[payload:payload + len(data)] = data
            length = len(data)
        else:
            for sock in self._overflow:
                self._send_overflow(sock, data, should_abort)
            length = OVERFLOW
        _LENGTH.pack_into(mm, base + _SEQ.size, length)
        mm[flags:flags + seg.num_readers] = bytes(seg.num_readers)
        seg.atomics.store_u64_release(base, self._next + 1)  # publish: everything above is visible first
        self._next += 1

    @staticmethod
    def _send_overflow(sock: zmq.Socket, data, should_abort: Callable[[], bool] | None) -> None:
        """A PUSH socket blocks while its reader is not connected (yet, or any more): retry
        until it is, or until `should_abort` says the reader is gone."""
        backoff = _Backoff(should_abort)
        while True:
            try:
                sock.send(data, copy=False, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                backoff.wait()

    def unlink(self) -> None:
        """Remove the file; the mapping stays valid in every process that has it."""
        if self._linked:
            self._linked = False
            try:
                os.unlink(self._seg.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        for sock in self._overflow:
            sock.close(linger=0)
        self._overflow = []
        self._seg.close()


class ShmRingReader:
    def __init__(self, name: str, rank: int, overflow_addr: str, ctx: zmq.Context) -> None:
        self._seg = _Segment(os.path.join(SHM_DIR, name), False)
        if not 0 <= rank < self._seg.num_readers:
            raise ValueError(f"reader rank {rank} out of range for {self._seg.num_readers} readers")
        self._rank = rank
        self._overflow = ctx.socket(zmq.PULL)
        self._overflow.setsockopt(zmq.LINGER, 0)
        self._overflow.connect(overflow_addr)
        self._next = 0

    def ready(self) -> bool:
        """Whether the next message is already published (never blocks)."""
        return self._seg.atomics.load_u64_acquire(self._seg.chunk(self._next)) == self._next + 1

    def read(self, should_abort: Callable[[], bool] | None = None, max_sleep_s: float = 1e-3) -> bytes:
        """The next message (blocking). `max_sleep_s`: the longest sleep between polls, so also
        about the longest delay before an arrived message is seen."""
        seg, mm = self._seg, self._seg.mm
        base = seg.chunk(self._next)
        want = self._next + 1
        backoff = _Backoff(should_abort, max_sleep_s)
        while seg.atomics.load_u64_acquire(base) != want:
            backoff.wait()
        length = _LENGTH.unpack_from(mm, base + _SEQ.size)[0]
        if length == OVERFLOW:
            while not self._overflow.poll(100):
                if should_abort is not None and should_abort():
                    raise RingAbortedError("the ring's writer is gone")
            data = self._overflow.recv()
        else:
            payload = seg.payload(base)
            data = mm[payload:payload + length]
        seg.atomics.store_u8_release(seg.flags(base) + self._rank, 1)  # done with the chunk
        self._next += 1
        return data

    def close(self) -> None:
        self._overflow.close(linger=0)
        self._seg.close()
