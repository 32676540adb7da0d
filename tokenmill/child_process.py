"""Starting tokenmill child processes without pickle, and tying their lives to their parent.

A child is `python -m <module> <json>`: its launch struct travels as JSON on the command
line, never through multiprocessing. A child calls `die_with_parent` first thing, so a
parent that dies for any reason (even SIGKILL) takes its children with it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec

_PR_SET_PDEATHSIG = 1
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


def init_child_process() -> None:
    """First thing in a child's entry point, before torch loads: pickle refused when
    TOKENMILL_FORBID_PICKLE is set (tests prove no channel uses it), idle OpenMP threads
    that sleep instead of spinning (see `tokenmill.cpu_threads`), and huge pages for torch's
    large CPU allocations (`tokenmill.cpu_memory`)."""
    from tokenmill.cpu_memory import set_allocator_defaults
    from tokenmill.cpu_threads import set_openmp_defaults
    from tokenmill.no_pickle import forbid_pickle_if_requested
    forbid_pickle_if_requested()
    set_openmp_defaults()
    set_allocator_defaults()


def package_root() -> str:
    """The directory holding this tokenmill package (children put it first on their path)."""
    return _PACKAGE_ROOT


def spawn_child(module: str, launch: msgspec.Struct) -> subprocess.Popen:
    env = dict(os.environ)
    # The child must import this very tokenmill, wherever the parent found it.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-m", module, msgspec.json.encode(launch).decode()]
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, close_fds=True)


def spawned_by_main_thread() -> bool:
    """PR_SET_PDEATHSIG fires when the parent *thread* exits: only safe for children that the
    main thread starts. Others rely on the watchdog alone."""
    return threading.current_thread() is threading.main_thread()


def die_with_parent(parent_pid: int, death_signal: bool = True, poll_s: float = 0.5) -> None:
    """SIGKILL this process when its parent dies: prctl(PR_SET_PDEATHSIG) on Linux (when
    `death_signal`), plus a watchdog thread on the parent pid (for other platforms, for
    children of other threads, and for the race where the parent died before prctl)."""
    if death_signal and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """Wait up to `timeout_s` for a child asked to exit, then kill it; always reaps it."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def exit_now(code: int) -> None:
    """End a child whose sockets are closed and messages delivered, skipping the slow
    interpreter teardown (torch and friends)."""
    import logging
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
