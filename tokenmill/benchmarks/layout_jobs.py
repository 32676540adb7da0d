"""The teacher-forced layout check (`layout_check`) with every layout's engine in its own process,
all started at once: the engines' start-ups (imports, weights, kernel compiles, graph captures)
overlap instead of adding up, and each layout's verdict is printed as soon as its scores are in.

A job is one engine (`JobSpec`, written as JSON for the child): the base job generates the greedy
continuations of the prompts and writes the sequences (`sequences.json`); every job (the base
too) waits for that file, scores the sequences with full prompt logprobs (`layout_check._score`),
runs the decode probe where asked (`decode_consistency.probe`), and leaves `<name>.npy` (the
positions' logprobs, sequences concatenated) and `<name>.json` (timings, probe). The parent
(`run_jobs`) starts at most `parallel` jobs at a time, in the order given (the base first),
reports each finished job to `on_done` and kills what is left at `budget_s` (a GPU call's limit),
so that the verdicts known by then still print.

The judging is `layout_check`'s: each layout's spread from the base against the reference's.
Concurrent engines on one GPU share its memory (each job names its KV blocks, so none sizes its
pool from what the others happen to leave) and its time (contexts are time-sliced): the logits
are computed by the same kernels as in a lone engine.

    python -m tokenmill.benchmarks.layout_jobs SPEC.json     # one job (what run_jobs starts)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

SEQUENCES = "sequences.json"


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One engine of the check. `engine`: every LLM(...) argument; `env`: set before the engine
    starts (a planted fault); `devices`: CUDA_VISIBLE_DEVICES of the job (None: inherited);
    `prompts` and `continuation`: the base job's (it writes the sequences); `probe_prompts`: the
    decode probe's (none: no probe)."""

    name: str
    model: str
    engine: Mapping[str, Any]
    workdir: str
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    devices: str | None = None
    prompts: Sequence[Sequence[int]] = ()
    continuation: int = 0
    probe_prompts: Sequence[Sequence[int]] = ()
    probe_tokens: int = 0
    wait_s: float = 600.0  # for the sequences file (and the model's, below)
    model_file: str = ""  # model "": its path is read from this file once it exists (weights made meanwhile)
    parent_pid: int = 0  # the job dies with it (and its engine's processes with the job); 0: no watch

    @property
    def is_base(self) -> bool:
        return bool(self.prompts)

    def path(self, suffix: str) -> str:
        """A file of this job in `workdir` (the layout's name with only [A-Za-z0-9._-] kept)."""
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", self.name)
        return os.path.join(self.workdir, f"{safe}{suffix}")


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _wait_for(spec: JobSpec, path: str, what: str) -> str:
    """The text of `path` once it exists (written atomically by another process)."""
    deadline = time.monotonic() + spec.wait_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{spec.name}: no {os.path.basename(path)} after {spec.wait_s:.0f} s ({what})")
        time.sleep(0.1)
    with open(path) as f:
        return f.read()


def _wait_for_sequences(spec: JobSpec) -> list[list[int]]:
    return json.loads(_wait_for(spec, os.path.join(spec.workdir, SEQUENCES), "the base job failed?"))


def run_job(spec: JobSpec) -> None:
    """The child's work (see the module's docstring)."""
    began = time.perf_counter()
    # INFO with times, here and in the engine's processes (they take this level): the log says
    # where a job killed at the budget was.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def note(what: str) -> None:
        print(f"[{spec.name}: {what} at {time.perf_counter() - began:.1f} s]", flush=True)

    if spec.parent_pid:  # a parent killed at a call's limit takes its jobs' engines with it
        from tokenmill.child_process import die_with_parent
        die_with_parent(spec.parent_pid)
    os.environ.update(spec.env)  # (before anything could start CUDA or an engine process)
    if spec.devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.devices
    from tokenmill import LLM, SamplingParams
    from tokenmill.benchmarks import decode_consistency as dc
    from tokenmill.benchmarks import layout_check as lc

    note("imported")
    vocab = int(spec.engine["max_logprobs"])
    model = spec.model or _wait_for(spec, spec.model_file, "the weights were not written?").strip()
    note("weights in")
    with LLM(model, **spec.engine) as llm:
        started = time.perf_counter()
        note("engine started")
        if spec.is_base:
            params = SamplingParams(temperature=0.0, max_tokens=spec.continuation, ignore_eos=True, detokenize=False)
            outs = llm.generate([{"prompt_token_ids": list(p)} for p in spec.prompts], params, use_tqdm=False)
            sequences = [list(p) + list(o.outputs[0].token_ids) for p, o in zip(spec.prompts, outs)]
            write_atomic(os.path.join(spec.workdir, SEQUENCES), json.dumps(sequences))
        else:
            sequences = _wait_for_sequences(spec)
        waited = time.perf_counter()
        note("sequences in")
        scores = lc._score(llm, lc.Layout(spec.name, {}), sequences, vocab)
        np.save(spec.path(".npy"), np.concatenate(scores))
        scored = time.perf_counter()
        note("scored")
        probe = dc.probe(llm, spec.probe_prompts, spec.probe_tokens) if spec.probe_prompts else None
    write_atomic(spec.path(".json"), json.dumps({
        "name": spec.name, "rows": [len(s) - 1 for s in sequences], "probe": probe,
        "seconds": {"start": started - began, "sequences": waited - started, "score": scored - waited,
                    "probe": time.perf_counter() - scored, "total": time.perf_counter() - began}}))


def load_scores(spec: JobSpec, remove: bool = True) -> tuple[list[np.ndarray], dict]:
    """A finished job's scores, split back into sequences, and its record; `remove`: the scores'
    file goes (tens of MB a layout: not for a GPU call's output folder)."""
    with open(spec.path(".json")) as f:
        record = json.load(f)
    flat = np.load(spec.path(".npy"))
    if remove:
        os.remove(spec.path(".npy"))
    bounds = np.cumsum(record["rows"])[:-1]
    return list(np.split(flat, bounds)), record


def write_spec(spec: JobSpec) -> str:
    path = spec.path(".spec.json")
    write_atomic(path, json.dumps(dataclasses.asdict(spec)))
    return path


def run_jobs(specs: Sequence[JobSpec], parallel: int, budget_s: float,
             on_done: Callable[[JobSpec, bool, str], None], python: str = sys.executable) -> dict[str, str]:
    """Run `specs` (at most `parallel` at once, in order), each in its own process group with its
    output in `<name>.log`; `on_done(spec, ok, log tail)` as each ends. At `budget_s` the jobs
    still running are killed and the ones not started are dropped. Returns each job's state:
    "ok", "failed (exit N)", "killed at the budget" or "not started"."""
    import signal
    os.makedirs(specs[0].workdir if specs else ".", exist_ok=True)
    deadline = time.monotonic() + budget_s
    waiting, running, states = list(specs), {}, {}
    while waiting or running:
        while waiting and len(running) < parallel:
            spec = dataclasses.replace(waiting.pop(0), parent_pid=os.getpid())
            log = open(spec.path(".log"), "w")
            running[spec.name] = (spec, log, subprocess.Popen(
                [python, "-m", "tokenmill.benchmarks.layout_jobs", write_spec(spec)], stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))
        for name, (spec, log, proc) in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            log.close()
            del running[name]
            ok = code == 0 and os.path.exists(spec.path(".json"))
            states[name] = "ok" if ok else f"failed (exit {code})"
            try:
                on_done(spec, ok, _tail(spec.path(".log")))
            except Exception as e:  # noqa: BLE001 - one job's bad result must not end the others' report
                import traceback
                traceback.print_exc()
                states[name] = f"failed ({type(e).__name__}: {e})"
        if time.monotonic() > deadline:
            for name, (spec, log, proc) in running.items():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                log.close()
                states[name] = "killed at the budget"
            states.update({s.name: "not started" for s in waiting})
            break
        time.sleep(0.2)
    return states


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.rsplit("\n\n", 1)[-1].strip(), file=sys.stderr)
        return 2
    with open(args[0]) as f:
        run_job(JobSpec(**json.load(f)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
