"""Shared tiny model for the multi-process tests."""

from __future__ import annotations

import pytest

from tests.helpers.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("e2e-model"))
