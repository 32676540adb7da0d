"""What `tokenmill serve`'s exit status tells a supervisor (systemd, Kubernetes, a shell loop)."""

from __future__ import annotations

from enum import IntEnum


class ExitStatus(IntEnum):
    STOPPED = 0  # asked to stop (SIGTERM / SIGINT): in-flight requests drained or aborted
    ERROR = 1  # an unexpected error (its traceback is in the log), e.g. the port is taken
    BAD_CONFIG = 2  # invalid flags or model (nothing served): fix the configuration, do not just restart
    ENGINE_DEAD = 3  # the engine died while serving (a process crashed, a step hung, raised or stalled): restart
