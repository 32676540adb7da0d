"""Child processes start with huge pages on for torch's large CPU allocations (`tokenmill.cpu_memory`).

Planted defects seen failing (this session): `set_allocator_defaults` not called from
`init_child_process` (the child's variable is unset, its weight-sized tensor on 4 KiB pages);
`os.environ[...] = "1"` instead of `setdefault` (the user's 0 overridden).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tokenmill.child_process import package_root
from tokenmill.cpu_memory import KEEP_ENV, THP_ENV

# A child's first lines, then one weight-sized tensor written once: the huge pages behind it.
_CHILD = r"""
import json, os
from tokenmill.child_process import init_child_process
init_child_process()
import torch
t = torch.ones(64 << 18)  # 64 MiB of float32
start, end = t.data_ptr(), t.data_ptr() + t.numel() * 4
huge, lo = 0, None
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and all(c in "0123456789abcdef-" for c in head):
        a, b = (int(x, 16) for x in head.split("-"))
        lo = (a, b) if a < end and b > start else None
    elif lo and head == "AnonHugePages:":
        huge += int(line.split()[1])
print(json.dumps({"env": os.environ.get("THP_MEM_ALLOC_ENABLE"), "huge_kib": huge}))
"""


def _run_child(env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != THP_ENV}
    if env_value is not None:
        env[THP_ENV] = env_value
    env["PYTHONPATH"] = package_root()
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def test_child_processes_default_to_huge_pages_and_the_user_wins() -> None:
    child = _run_child(None)
    assert child["env"] == "1"
    if _thp_mode() in ("madvise", "always"):
        assert child["huge_kib"] >= 32 << 10, child  # at least half the tensor on 2 MiB pages
    assert _run_child("0")["env"] == "0"  # a value the user set is kept


@pytest.mark.skipif(_thp_mode() != "madvise", reason="only THP mode madvise tells the two apart")
def test_without_the_default_the_tensor_gets_small_pages() -> None:
    assert _run_child("0")["huge_kib"] == 0


# A step's activation freed and allocated again: the minor page faults of the second one's writes.
_REUSE_CHILD = r"""
import json, resource
from tokenmill.child_process import init_child_process
init_child_process()
import torch
torch.ones(8 << 18).fill_(2.0)  # 8 MiB, written, freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(8 << 18).fill_(3.0)
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activations_are_reused_without_fresh_pages() -> None:
    """Planted defect seen failing: `keep_freed_memory` not called from `set_allocator_defaults`."""
    def faults(keep: str) -> int:
        env = {**os.environ, THP_ENV: "0", KEEP_ENV: keep, "PYTHONPATH": package_root()}
        out = subprocess.run([sys.executable, "-c", _REUSE_CHILD], env=env, capture_output=True, text=True,
                             timeout=120, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])["faults"]
    assert faults("1") < 64  # the freed block's pages, still mapped
    assert faults("0") >= 1024  # a fresh mapping: a fault per 4 KiB page written (2048)
