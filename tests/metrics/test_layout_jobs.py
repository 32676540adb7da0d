"""The layout check's job runner (benchmarks/layout_jobs.run_jobs) with stand-in jobs: a small
script in place of the Python that would start each engine, so the scheduling, the verdicts'
inputs and the budget's kill are checked in a second, without an engine. (The jobs with real
engines run in `scripts/gpu_layouts.py --parts check`, and its `--smoke` mode on CPU.)"""

from __future__ import annotations

import json
import os
import stat
import sys
import time

import numpy as np

from tokenmill.benchmarks import layout_jobs as lj

# Stands in for `python -m tokenmill.benchmarks.layout_jobs SPEC`: "slow" sleeps past the budget,
# "broken" exits 3, the others leave their scores (rows of the job's index) and record.
FAKE = f"""#!{sys.executable}
import json, sys, time
import numpy as np
spec = json.load(open(sys.argv[3]))
name = spec["name"]
if name == "slow":
    time.sleep(60)
if name == "broken":
    print("engine failed to start", flush=True)
    sys.exit(3)
safe = name.replace("=", "_").replace(",", "_").replace(":", "_")
np.save(f"{{spec['workdir']}}/{{safe}}.npy", np.full((5, 4), float(len(name)), dtype=np.float32))
json.dump({{"name": name, "rows": [2, 3], "probe": None, "seconds": {{}}}}, open(f"{{spec['workdir']}}/{{safe}}.json", "w"))
"""


def test_jobs_report_as_they_end_and_the_budget_kills_the_rest(tmp_path):
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    work = str(tmp_path / "jobs")
    os.makedirs(work)
    specs = [lj.JobSpec(name, "model", {"max_logprobs": 4}, work) for name in
             ("one", "pp=2,split=1:1", "broken", "slow", "queued")]
    done = []

    def on_done(spec, ok, tail):
        if ok:
            scores, record = lj.load_scores(spec)
            assert [s.shape for s in scores] == [(2, 4), (3, 4)]  # split back into the sequences' rows
            assert float(scores[0][0, 0]) == len(spec.name)
            assert not os.path.exists(spec.path(".npy"))  # read once, then removed
        else:
            assert "engine failed to start" in tail
        done.append((spec.name, ok))

    start = time.monotonic()
    # one at a time, in order: "slow" is running when the budget ends, "queued" never starts
    states = lj.run_jobs(specs, parallel=1, budget_s=6.0, on_done=on_done, python=str(fake))
    assert time.monotonic() - start < 15  # "slow" did not hold the call for its 60 s
    assert sorted(done) == [("broken", False), ("one", True), ("pp=2,split=1:1", True)]
    assert states == {"one": "ok", "pp=2,split=1:1": "ok", "broken": "failed (exit 3)",
                      "slow": "killed at the budget", "queued": "not started"}
    spec = json.loads(open(specs[1].path(".spec.json")).read())
    assert spec["parent_pid"] == os.getpid() and specs[1].path(".log").endswith("pp_2_split_1_1.log")


def test_a_job_spec_survives_its_json():
    spec = lj.JobSpec("tp2", "m", {"max_logprobs": 8, "tensor_parallel_size": 2}, "/tmp/w", {"A": "1"}, "0",
                      prompts=[[1, 2]], continuation=3, probe_prompts=[[4]], probe_tokens=2)
    back = lj.JobSpec(**json.loads(json.dumps(spec.__dict__)))
    assert back.is_base and back.engine == spec.engine and back.prompts == [[1, 2]]
    assert np.asarray(back.probe_prompts).tolist() == [[4]]
