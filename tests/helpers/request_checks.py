"""Counting the front-end's request checks, to prove each request is checked once."""

from __future__ import annotations

import pytest

from tokenmill.frontend.input_processor import InputProcessor
from tokenmill.sampling_params import SamplingParams


def count_request_checks(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Live counts of the parameter checks (`SamplingParams.validate`) and the tokenizations
    (`InputProcessor.tokenize`, which the model's checks follow) from now on."""
    counts = {"validate": 0, "tokenize": 0}
    validate, tokenize = SamplingParams.validate, InputProcessor.tokenize

    def counting_validate(self, **kwargs):
        counts["validate"] += 1
        return validate(self, **kwargs)

    def counting_tokenize(self, prompt):
        counts["tokenize"] += 1
        return tokenize(self, prompt)

    monkeypatch.setattr(SamplingParams, "validate", counting_validate)
    monkeypatch.setattr(InputProcessor, "tokenize", counting_tokenize)
    return counts
