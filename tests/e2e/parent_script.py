"""Run by test_lifecycle: start an LLM, generate once, print the process ids, then wait to be killed.

`python -m tests.e2e.parent_script MODEL_DIR` prints one JSON line
{"pid", "core", "workers", "run_dir", "text", "pickle_forbidden"} after a generate.
"""

from __future__ import annotations

import json
import pickle
import sys
import time

from tests.e2e.procs import engine_pids
from tokenmill import LLM, SamplingParams
from tokenmill.no_pickle import forbid_pickle_if_requested


def main() -> None:
    forbid_pickle_if_requested()  # the children install the ban themselves
    llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory_gb=0.01)
    out = llm.generate(["hello", "world"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    try:
        pickle.dumps(1)
        forbidden = False
    except RuntimeError:
        forbidden = True
    core, workers = engine_pids(llm)
    print(json.dumps({"core": core, "workers": sorted(workers), "run_dir": llm.client.core.run_dir,
                      "text": [o.outputs[0].token_ids for o in out], "pickle_forbidden": forbidden}),
          flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
