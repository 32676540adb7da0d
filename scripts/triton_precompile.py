"""Compile a sweep's Triton kernels in parallel processes before timing them.

Compiling, not timing, is most of a sweep's time; Triton's on-disk cache lets the timed calls find
each kernel compiled. A sweep script lists its calls (callables, or (label, callable) pairs), runs
itself as `python SCRIPT FLAG i/n` in n processes through `compile_in_processes`, and each child
calls `compile_shard` on its i-th share of the calls. A call that fails here is only printed: the
sweep reports it again when it times it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Callable, Iterable


def compile_shard(calls: Iterable[Callable[[], object] | tuple[str, Callable[[], object]]], shard: str) -> None:
    """Run every n-th call from the i-th (`shard` is "i/n"), then wait for the device."""
    import torch

    i, n = map(int, shard.split("/"))
    for j, item in enumerate(calls):
        if j % n != i:
            continue
        label, call = item if isinstance(item, tuple) else ("", item)
        try:
            call()
        except Exception as e:  # noqa: BLE001 - reported again when timed
            print(f"  precompile {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    torch.cuda.synchronize()


def compile_in_processes(script: str, flag: str, shards: int, timeout: float, what: str) -> None:
    """Start `shards` processes of `script FLAG i/shards` and wait for them, killing any still
    running after `timeout` seconds in all."""
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(script), flag, f"{i}/{shards}"])
             for i in range(shards)]
    for p in procs:
        try:
            p.wait(timeout=max(1.0, timeout - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            p.kill()
    print(f"  {what}: compiled in {shards} processes: {time.perf_counter() - start:.0f} s", flush=True)
