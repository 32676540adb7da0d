"""The skip-or-fail helpers (tests/helpers/requirements.py): CI set to a false value (empty, 0,
false, no) is a developer's machine, where a missing requirement skips; any other value is CI,
where it fails. Triton's guard goes through the same rule."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.requirements import in_ci, require_module
from tests.helpers.triton_required import require_triton


@pytest.mark.parametrize("value,ci", [("", False), ("0", False), ("false", False), ("No", False),
                                      ("true", True), ("1", True), ("yes", True)])
def test_ci_values(monkeypatch, value, ci) -> None:
    monkeypatch.setenv("CI", value)
    assert in_ci() is ci


@pytest.mark.parametrize("value", ["0", "true"])
def test_a_missing_requirement_skips_off_ci_and_fails_in_ci(monkeypatch, value) -> None:
    monkeypatch.setenv("CI", value)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    outcome = pytest.fail.Exception if value == "true" else pytest.skip.Exception
    with pytest.raises(outcome, match="triton is not installed"):
        require_triton()
    with pytest.raises(outcome, match="not_a_module_of_the_extras is not installed"):
        require_module("not_a_module_of_the_extras")
