"""The names and framing every process agrees on: socket addresses per engine, frame heads, timeouts.

Per engine the front-end makes a run directory; every ipc socket lives in it and every shared
memory segment is named after it, so engines never collide and cleanup finds everything.

Socket messages are multipart. Front-end <-> core: [kind byte, payload]. Workers -> core:
[reply head (kind byte, rank u16 LE), payload]. Ring messages carry the kind as their first byte.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

REPLY_HEAD = struct.Struct("<BH")  # kind, rank

POLL_MS = 100  # how often a blocked receiver looks at its peer's liveness
LAST_WORDS_S = 0.3  # after a peer exits, how long its ErrorReport may still take to arrive
SHUTDOWN_TIMEOUT_S = 10.0  # how long a child may take to exit when asked, before it is killed
HEARTBEAT_S = 1.0  # while it has work, the core sends outputs (empty if need be) at least this often


@dataclass(frozen=True)
class EngineAddresses:
    """Where one engine's sockets and shared memory live."""

    run_dir: str

    @property
    def core_input(self) -> str:
        return f"ipc://{self.run_dir}/input"

    @property
    def core_output(self) -> str:
        return f"ipc://{self.run_dir}/output"

    @property
    def worker_replies(self) -> str:
        return f"ipc://{self.run_dir}/worker-replies"

    def ring_overflow(self, rank: int) -> str:
        return f"ipc://{self.run_dir}/ring-overflow-{rank}"

    @property
    def ring_name(self) -> str:
        return f"{self.shm_prefix}-ring"

    @property
    def shm_prefix(self) -> str:
        """Every shared-memory segment of this engine starts with this name."""
        return os.path.basename(self.run_dir)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for a rendezvous the caller starts at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
