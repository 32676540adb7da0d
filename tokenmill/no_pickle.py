"""TOKENMILL_FORBID_PICKLE=1 makes pickling raise in this process (tests prove no channel uses it).

Every child process (engine core, workers) calls `forbid_pickle_if_requested()` first thing
(`tokenmill.child_process.init_child_process`); a front-end that wants the same calls it itself,
since importing tokenmill changes nothing in the caller's process.
"""

from __future__ import annotations

import os
import pickle

ENV_VAR = "TOKENMILL_FORBID_PICKLE"


class PickleForbiddenError(RuntimeError):
    pass


def _refuse(*_args, **_kwargs):
    raise PickleForbiddenError(f"pickle is forbidden in tokenmill processes ({ENV_VAR}=1)")


class _ForbiddenPickler:
    def __init__(self, *_args, **_kwargs) -> None:
        _refuse()


def forbid_pickle_if_requested() -> bool:
    """Replace pickle's entry points with ones that raise; True when the env var asked for it."""
    if os.environ.get(ENV_VAR, "") not in ("1", "true", "yes"):
        return False
    # jinja2 (imported by transformers) pickles a version constant at import time; import it
    # before the ban. That is not a channel; nothing else is exempt.
    try:
        import jinja2.bccache  # noqa: F401
    except ImportError:
        pass
    for name in ("dumps", "loads", "dump", "load"):
        setattr(pickle, name, _refuse)
    pickle.Pickler = _ForbiddenPickler  # type: ignore[misc, assignment]
    pickle.Unpickler = _ForbiddenPickler  # type: ignore[misc, assignment]
    return True
