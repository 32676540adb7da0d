"""Module-level guard for tests of Triton kernels: skip without triton, except under CI.

CI installs triton with the test extras, so there a missing triton is a failure, not a skip.
Call it after setting TRITON_INTERPRET and before importing any kernel module.
"""

from __future__ import annotations

import os

import pytest


def require_triton() -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("triton is not installed, but CI installs it with the test extras", pytrace=False)
        pytest.skip("triton is not installed", allow_module_level=True)
