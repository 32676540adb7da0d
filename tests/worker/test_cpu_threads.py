"""StepThreads: every core unless other processes keep the CPUs busy (read from /proc), a fixed count
from TOKENMILL_CPU_STEP_THREADS, and the timing probe where /proc cannot be read."""

import pytest
import torch

from tokenmill import cpu_threads
from tokenmill.cpu_threads import StepThreads


def _loads(monkeypatch, readings):
    """_cpu_load returns these (time, all CPUs' busy ticks, own ticks) in turn."""
    it = iter(readings)
    monkeypatch.setattr(cpu_threads, "_cpu_load", lambda: next(it))
    monkeypatch.setattr(cpu_threads, "_TICKS_PER_S", 100)


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    monkeypatch.delenv(cpu_threads.STEP_THREADS_ENV, raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_idle_machine_runs_every_core(monkeypatch):
    # 2 s: all CPUs 150 ticks busy, 120 of them ours -> others 0.15 cores
    _loads(monkeypatch, [(0.0, 1000, 500), (2.0, 1150, 620)])
    st = StepThreads(torch.float32, 16, 32, max_threads=2)
    assert st.apply() == 2


def test_busy_machine_runs_one_thread(monkeypatch):
    # 2 s: 300 ticks busy, 100 ours -> another process kept a whole core busy
    _loads(monkeypatch, [(0.0, 1000, 500), (2.0, 1300, 600)])
    st = StepThreads(torch.float32, 16, 32, max_threads=2)
    assert st.apply() == 1
    assert st.chosen == {1: 1}


def test_stolen_time_counts_as_busy(monkeypatch):
    # the hypervisor's steal is in /proc/stat's busy ticks too: the real reader must add it
    fields = "cpu 100 0 50 900 0 0 0 70 0 0"
    monkeypatch.setattr(cpu_threads, "open", lambda path: __import__("io").StringIO(
        fields + "\n" if path == "/proc/stat" else "1 (py thon) S 1 1 1 0 -1 0 0 0 0 0 40 2 0 0"), raising=False)
    _, busy, own = cpu_threads._cpu_load()
    assert (busy, own) == (100 + 50 + 70, 42)


def test_the_engine_core_and_frontend_count_as_own_load(monkeypatch):
    # the worker's ancestors (engine core, frontend) work between steps: their ticks are the
    # engine's own, or an idle machine's steps would go to one thread; the walk stops at init
    stats = {"/proc/stat": "cpu 100 0 50 900 0 0 0 0 0 0",
             "/proc/self/stat": "30 (worker) S 20 1 1 0 -1 0 0 0 0 0 40 2 0 0",
             "/proc/20/stat": "20 (engine core) S 10 1 1 0 -1 0 0 0 0 0 7 1 0 0",
             "/proc/10/stat": "10 (py thon) S 1 1 1 0 -1 0 0 0 0 0 5 5 0 0"}
    monkeypatch.setattr(cpu_threads, "open", lambda path: __import__("io").StringIO(stats[path] + "\n"),
                        raising=False)
    _, busy, own = cpu_threads._cpu_load()
    assert (busy, own) == (150, 42 + 8 + 10)


def test_fixed_threads_from_env(monkeypatch):
    monkeypatch.setenv(cpu_threads.STEP_THREADS_ENV, "1")
    _loads(monkeypatch, [(0.0, 0, 0)] * 4)  # an idle machine would get every core
    st = StepThreads(torch.float32, 16, 32, max_threads=2)
    assert st.apply() == 1 and torch.get_num_threads() == 1


def test_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(cpu_threads.STEP_THREADS_ENV, "two")
    with pytest.raises(ValueError, match=cpu_threads.STEP_THREADS_ENV):
        cpu_threads.fixed_threads()


def test_without_proc_the_timing_probe_decides(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_cpu_load", lambda: None)
    st = StepThreads(torch.float32, 16, 32, max_threads=2)
    monkeypatch.setattr(st, "_timing_probe", lambda: 1)
    assert st.apply() == 1
