"""`import tokenmill` (and its public names) changes nothing in the caller's process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parent.parent)

_PROBE = """
import json, os, pickle, sys
before = (dict(os.environ), pickle.dumps, pickle.loads, pickle.Pickler, sys.getswitchinterval())
import tokenmill
from tokenmill import LLM, SamplingParams, EngineArgs
after = (dict(os.environ), pickle.dumps, pickle.loads, pickle.Pickler, sys.getswitchinterval())
changed_env = sorted(k for k in set(before[0]) | set(after[0]) if before[0].get(k) != after[0].get(k))
print(json.dumps({"env": changed_env, "same_pickle": before[1:4] == after[1:4],
                  "same_switch": before[4] == after[4], "pickles": len(pickle.dumps(1)) > 0}))
"""


def test_import_changes_no_environment_and_patches_nothing():
    env = dict(os.environ, PYTHONPATH=REPO, TOKENMILL_FORBID_PICKLE="1")
    env.pop("OMP_WAIT_POLICY", None)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"env": [], "same_pickle": True, "same_switch": True, "pickles": True}
