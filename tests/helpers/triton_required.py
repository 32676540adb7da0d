"""Module-level guard for tests of Triton kernels: skip without triton, except under CI.

CI installs triton with the test extras, so there a missing triton is a failure, not a skip
(`requirements.in_ci`: CI set to anything but empty, 0, false or no). Call it after setting
TRITON_INTERPRET and before importing any kernel module.
"""

from __future__ import annotations

from tests.helpers.requirements import skip_or_fail


def require_triton() -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        skip_or_fail("triton is not installed, but the test extras install it (pip install -e '.[test]')")
