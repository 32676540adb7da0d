"""The shared-memory ring on its own: order, N readers, wraparound, large messages, cleanup."""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import zmq

from tokenmill.transport.shm_ring import SHM_DIR, RingAbortedError, ShmRingReader, ShmRingWriter


@pytest.fixture
def ring_env(tmp_path):
    ctx = zmq.Context()
    name = f"tokenmill-test-{uuid.uuid4().hex[:8]}"
    yield ctx, name, [f"ipc://{tmp_path}/overflow-{r}" for r in range(3)]
    ctx.term()
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def _messages(count: int, big_every: int = 0) -> list[bytes]:
    out = []
    for i in range(count):
        size = 5000 + i if big_every and i % big_every == 0 else i % 50
        out.append(bytes([i % 251]) * size + i.to_bytes(4, "little"))
    return out


def _run(ctx, name, addrs, num_readers, messages, **ring_kw) -> list[list[bytes]]:
    writer = ShmRingWriter(name, num_readers, addrs[:num_readers], ctx, **ring_kw)
    readers = [ShmRingReader(name, r, addrs[r], ctx) for r in range(num_readers)]
    writer.unlink()  # every reader has mapped it: the ring keeps working without the file
    got: list[list[bytes]] = [[] for _ in range(num_readers)]

    def read(r: int) -> None:
        for _ in messages:
            got[r].append(readers[r].read())

    threads = [threading.Thread(target=read, args=(r,)) for r in range(num_readers)]
    for t in threads:
        t.start()
    for m in messages:
        writer.write(m)
    for t in threads:
        t.join(timeout=30)
    for reader in readers:
        reader.close()
    writer.close()
    return got


def test_order_and_wraparound_with_three_readers(ring_env) -> None:
    ctx, name, addrs = ring_env
    messages = _messages(200)
    got = _run(ctx, name, addrs, 3, messages, num_chunks=4, chunk_size=256)
    assert all(g == messages for g in got)


def test_large_messages_fall_back_to_zmq_in_order(ring_env) -> None:
    ctx, name, addrs = ring_env
    messages = _messages(60, big_every=7)
    assert max(map(len, messages)) > 256
    got = _run(ctx, name, addrs, 2, messages, num_chunks=3, chunk_size=256)
    assert all(g == messages for g in got)


def test_writer_never_overwrites_an_unread_chunk(ring_env) -> None:
    ctx, name, addrs = ring_env
    writer = ShmRingWriter(name, 2, addrs[:2], ctx, num_chunks=2, chunk_size=64)
    fast, slow = ShmRingReader(name, 0, addrs[0], ctx), ShmRingReader(name, 1, addrs[1], ctx)
    writer.write(b"a")
    writer.write(b"b")
    assert fast.read() == b"a" and fast.read() == b"b"
    with pytest.raises(RingAbortedError):  # the slow reader still holds chunk 0
        writer.write(b"c", should_abort=lambda: True)
    assert slow.read() == b"a"
    writer.write(b"c")
    assert slow.read() == b"b" and slow.read() == b"c" and fast.read() == b"c"
    for end in (fast, slow, writer):
        end.close()


def test_reader_gives_up_when_told(ring_env) -> None:
    ctx, name, addrs = ring_env
    writer = ShmRingWriter(name, 1, addrs[:1], ctx)
    reader = ShmRingReader(name, 0, addrs[0], ctx)
    with pytest.raises(RingAbortedError):
        reader.read(should_abort=lambda: True)
    reader.close()
    writer.close()
