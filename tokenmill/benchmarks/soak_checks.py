"""The soak's reconciliation: what the client saw against the server's /metrics, the engine holding
nothing once idle, and the server's process tree (processes, fds, shared memory) unchanged.

Token counts: prompt tokens are known for every request the engine saw (usage, or the token
ids sent), so they match /metrics exactly unless a request failed after it was admitted.
Generated tokens are exact for completed requests; a cancelled stream generated at least what
the client read and at most its max_tokens, so the total is checked within those bounds
(exactly, when nothing was cancelled). Finished choices match `request_success` exactly
(a client that goes away finishes nothing).
"""

from __future__ import annotations

import asyncio
import glob
import os
import time
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.benchmarks.soak_requests import Outcome


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None  # None: could not be checked
    detail: str


@dataclass(frozen=True)
class ProcessTree:
    pids: frozenset[int]
    fds: int  # open file descriptors, all processes together
    shm: frozenset[str]  # shared-memory segments mapped (deleted ones included)

    def as_dict(self) -> dict:
        return {"processes": len(self.pids), "fds": self.fds, "shm_segments": len(self.shm)}


async def scrape(client, base_url: str, headers: dict) -> dict[str, float]:
    """/metrics as {sample name (with its finished_reason, if any): value summed over labels}."""
    response = await client.get(base_url + "/metrics", headers=headers)
    response.raise_for_status()
    figures: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason")
            key = f"{sample.name}{{{reason}}}" if reason else sample.name
            figures[key] = figures.get(key, 0.0) + sample.value
    return figures


async def wait_engine_idle(client, base_url: str, headers: dict, timeout_s: float) -> dict | None:
    """/debug/engine once it holds no request and every KV block is free (or at the timeout);
    None when the server does not serve it (start it with --enable-debug-routes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = await client.get(base_url + "/debug/engine", headers=headers)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        stats = response.json()
        if _idle(stats) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


def _idle(stats: dict) -> bool:
    kv = stats["kv_cache"]
    return kv["num_requests"] == 0 and kv["num_free_blocks"] == kv["num_blocks"] and stats["admitted_sequences"] == 0


def find_listener(port: int) -> int | None:
    """The pid of the process listening on TCP `port` on this machine (None if not found)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(cols[9])
    targets = {f"socket:[{inode}]" for inode in inodes}
    for fd_dir in glob.glob("/proc/[0-9]*/fd"):
        try:
            if any(os.readlink(os.path.join(fd_dir, fd)) in targets for fd in os.listdir(fd_dir)):
                return int(fd_dir.split("/")[2])
        except OSError:
            continue
    return None


def process_tree(pid: int) -> ProcessTree:
    """`pid` and its descendants: their fds and mapped shared-memory segments."""
    parents: dict[int, list[int]] = {}
    for stat_path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat_path) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X"):
            parents.setdefault(int(fields[1]), []).append(int(stat_path.split("/")[2]))
    tree, todo = {pid}, [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    fds, shm = 0, set()
    for p in tree:
        try:
            fds += len(os.listdir(f"/proc/{p}/fd"))
            shm.update(_shm_mappings(p))
        except OSError:
            continue
    return ProcessTree(frozenset(tree), fds, frozenset(shm))


def _shm_mappings(pid: int) -> set[str]:
    found = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            cols = line.split(None, 5)
            if len(cols) == 6 and cols[5].startswith("/dev/shm/"):
                found.add(cols[5].strip())
    return found


async def settled_tree(pid: int, baseline: ProcessTree, timeout_s: float) -> ProcessTree:
    """The tree once it is back to the baseline's size (closed connections take a moment to go),
    or as it is at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        tree = process_tree(pid)
        if (tree.pids == baseline.pids and tree.fds <= baseline.fds and tree.shm == baseline.shm) \
                or time.monotonic() > deadline:
            return tree
        await asyncio.sleep(0.2)


def reconcile(outcomes: list[Outcome], before: dict[str, float], after: dict[str, float], engine: dict | None,
              tree_before: ProcessTree | None, tree_after: ProcessTree | None) -> list[Check]:
    checks = []
    counts = {s: sum(o.state == s for o in outcomes) for s in ("completed", "cancelled", "rejected", "failed", "lost")}
    checks.append(Check("sent = completed + cancelled + rejected + failed", counts["lost"] == 0,
                        f"{len(outcomes)} = " + " + ".join(f"{counts[s]} {s}" for s in counts)))
    unexpected = [o for o in outcomes if not o.expected]
    checks.append(Check("every request ended as its kind should", not unexpected,
                        f"{len(unexpected)} unexpected" + (f", e.g. {unexpected[0].kind} -> {unexpected[0].state} "
                                                           f"({unexpected[0].detail})" if unexpected else "")))

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    admitted_failures = [o for o in outcomes if o.state == "failed" and not o.overloaded]
    seen_prompt = sum(o.prompt_tokens or 0 for o in outcomes if o.state in ("completed", "cancelled"))
    metric_prompt = delta("tokenmill:prompt_tokens_total")
    if admitted_failures:
        checks.append(Check("prompt tokens = /metrics", None, f"{len(admitted_failures)} admitted request(s) "
                                                              f"failed: their prompt tokens are unknown"))
    else:
        checks.append(Check("prompt tokens = /metrics", metric_prompt == seen_prompt,
                            f"client {seen_prompt}, /metrics {metric_prompt:.0f}"))
    done_tokens = sum(o.completion_tokens for o in outcomes if o.state == "completed")
    low = done_tokens + sum(o.completion_tokens for o in outcomes if o.state == "cancelled")
    high = done_tokens + sum(o.max_completion_tokens for o in outcomes
                             if o.state == "cancelled" or (o.state == "failed" and not o.overloaded))
    metric_gen = delta("tokenmill:generation_tokens_total")
    checks.append(Check("generated tokens = /metrics" + (" (within cancelled streams' bounds)" if high > low else ""),
                        low <= metric_gen <= high,
                        f"client {low}" + (f"..{high}" if high > low else "") + f", /metrics {metric_gen:.0f}"))
    finished = sum(o.finished_choices for o in outcomes)
    metric_finished = sum(delta(f"tokenmill:request_success_total{{{r}}}") for r in ("stop", "length", "abort"))
    checks.append(Check("finished choices = /metrics", finished == metric_finished,
                        f"client {finished}, /metrics {metric_finished:.0f}"))

    if engine is None:
        checks.append(Check("engine holds no request and no KV block", None,
                            "GET /debug/engine is off: start the server with --enable-debug-routes"))
    else:
        kv = engine["kv_cache"]
        checks.append(Check("engine holds no request and no KV block", _idle(engine),
                            f"{kv['num_requests']} requests, {kv['num_blocks'] - kv['num_free_blocks']} of "
                            f"{kv['num_blocks']} blocks held (prefix-cached free blocks count as free), "
                            f"{engine['admitted_sequences']} sequences admitted"))
    if tree_before is None or tree_after is None:
        checks.append(Check("no leaked processes, fds or shared memory", None, "the server's pid is unknown: pass --server-pid (the server's process, on this machine)"))
    else:
        b, a = tree_before, tree_after
        ok = a.pids == b.pids and a.fds <= b.fds and a.shm == b.shm
        checks.append(Check("no leaked processes, fds or shared memory", ok,
                            f"processes {len(b.pids)} -> {len(a.pids)}, fds {b.fds} -> {a.fds}, "
                            f"shm segments {len(b.shm)} -> {len(a.shm)}"))
    return checks
