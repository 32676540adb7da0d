"""Startup failures, engine deaths, a dying parent, no pickle."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.procs import alive, descendants, engine_pids, leftovers, wait_gone
from tokenmill import LLM, SamplingParams
from tokenmill.errors import EngineDeadError

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.01)
REPO = str(Path(__file__).resolve().parents[2])


def test_bad_model_path_raises_value_error_before_spawning(tmp_path) -> None:
    before = set(descendants(os.getpid()))  # an earlier test's processes may still be exiting
    start = time.monotonic()
    with pytest.raises(ValueError, match="nope"):
        LLM(str(tmp_path / "nope"), **ENGINE)
    assert time.monotonic() - start < 2.0
    assert not set(descendants(os.getpid())) - before  # nothing was spawned


def test_worker_startup_error_reaches_the_user_as_value_error(tiny_model, tmp_path) -> None:
    """The front-end cannot see missing weights; the worker's ValueError comes back as one."""
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_model, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    before = descendants(os.getpid())
    with pytest.raises(ValueError, match="safetensors") as err:
        LLM(str(broken), **ENGINE)
    assert "worker 0" in "".join(getattr(err.value, "__notes__", []))
    assert not wait_gone(descendants(os.getpid()) - before, 5.0)


def _generate_until_killed(tiny_model, victim: str) -> None:
    llm = LLM(tiny_model, max_num_seqs=1, **ENGINE)  # one request at a time: a long run
    core, workers = engine_pids(llm)
    run_dir = llm.client.core.run_dir
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    result: dict = {}

    def run() -> None:
        try:
            llm.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(100)], params, use_tqdm=False)
            result["error"] = None
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            result["error"] = exc
        result["at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive(), "generation ended before the kill"
    killed_at = time.monotonic()
    os.kill(core if victim == "core" else min(workers), signal.SIGKILL)
    thread.join(timeout=10)
    assert not thread.is_alive(), "generate hung after the kill"
    assert isinstance(result["error"], EngineDeadError), result["error"]
    assert result["at"] - killed_at < 5.0
    with pytest.raises(EngineDeadError):  # and every later request too
        llm.generate(["again"], params, use_tqdm=False)
    assert not wait_gone({core, *workers}, 5.0), "engine processes outlived the failure"
    llm.shutdown()
    assert not leftovers(run_dir)


def test_killed_worker_fails_generate_with_engine_dead_error(tiny_model) -> None:
    _generate_until_killed(tiny_model, "worker")


def test_killed_core_fails_generate_with_engine_dead_error(tiny_model) -> None:
    _generate_until_killed(tiny_model, "core")


def test_hung_worker_ends_the_engine_after_the_step_timeout(tiny_model) -> None:
    """A worker that is alive but stuck (SIGSTOP) is only caught by the step timeout."""
    timeout_s = 2.0
    llm = LLM(tiny_model, max_num_seqs=1, step_timeout=timeout_s, **ENGINE)
    core, workers = engine_pids(llm)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    result: dict = {}

    def run() -> None:
        try:
            llm.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(100)], params, use_tqdm=False)
            result["error"] = None
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            result["error"] = exc
        result["at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive(), "generation ended before the worker was stopped"
    stopped_at = time.monotonic()
    os.kill(min(workers), signal.SIGSTOP)
    try:
        thread.join(timeout=timeout_s + 10)
        assert not thread.is_alive(), "generate hung on a stopped worker"
        assert isinstance(result["error"], EngineDeadError), result["error"]
        assert "step_timeout" in str(result["error"])
        # Order, not a lower bound on time (a loaded machine stretches the step before the stop):
        # the error came after the stop and names the step timeout, the only thing that can see
        # a stopped worker; bounded above so that a hang still fails.
        assert stopped_at < result["at"] < stopped_at + timeout_s + 5.0
        assert not wait_gone({core, *workers}, 10.0), "engine processes outlived the failure"
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    llm.shutdown()


def test_killed_parent_takes_the_engine_down_and_nothing_pickles(tiny_model) -> None:
    """The helper runs a whole generate with pickle forbidden in every process, then is SIGKILLed."""
    env = dict(os.environ, TOKENMILL_FORBID_PICKLE="1", PYTHONPATH=REPO)
    parent = subprocess.Popen([sys.executable, "-m", "tests.e2e.parent_script", tiny_model], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        assert line, f"helper exited with {parent.wait()}"
        info = json.loads(line)
        assert info["pickle_forbidden"] and len(info["text"]) == 2 and len(info["text"][0]) == 8
        engine = {info["core"], *info["workers"]}
        assert all(alive(p) for p in engine) and info["workers"]
        for pid in engine:  # every child installs the ban at its start when it has the env var
            assert b"TOKENMILL_FORBID_PICKLE=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert not wait_gone(engine, 5.0), "engine processes outlived their parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert not leftovers(info["run_dir"])  # the socket files went at startup, the ring once mapped
