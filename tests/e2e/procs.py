"""Process-tree helpers for the multi-process tests (Linux /proc, no extra dependencies)."""

from __future__ import annotations

import glob
import os
import time


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid), or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for path in glob.glob("/proc/[0-9]*"):
        child = int(os.path.basename(path))
        stat = _stat(child)
        if stat is not None:
            children.setdefault(stat[1], []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return {p for p in found if alive(p)}


def wait_gone(pids, timeout_s: float) -> set[int]:
    """The pids still alive after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {p for p in left if alive(p)}
    return left


def engine_pids(llm) -> tuple[int, set[int]]:
    """The engine-core pid and its workers' pids, for a multi-process LLM or AsyncLLM."""
    core = llm.client.core.pid
    deadline = time.monotonic() + 5
    workers = descendants(core)
    while not workers and time.monotonic() < deadline:
        time.sleep(0.05)
        workers = descendants(core)
    return core, workers


def leftovers(run_dir: str) -> list[str]:
    """Files an engine may leave behind: its ipc dir and shared-memory segments."""
    name = os.path.basename(run_dir)
    return ([run_dir] if os.path.exists(run_dir) else []) + glob.glob(f"/dev/shm/{name}*")
