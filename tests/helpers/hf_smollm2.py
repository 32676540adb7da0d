"""HF transformers' SmolLM2, loaded from its GGUF once per test run and shared by the xdist workers.

transformers reads a GGUF slowly (~20 s on a quiet two-core machine, gguf-py's field parsing): the
first fixture that needs HF's SmolLM2 loads it from the GGUF as before, and saves HF's own weights
(dequantized float32 safetensors) and config into a directory of this run; every later load reads
that directory (~1 s). The copy is HF's model (its GGUF loader's weights, not tokenmill's), so the
comparisons against it are unchanged; `load_hf_smollm2` checks the copy's logits equal the GGUF
model's bit for bit when it writes it. `tests/model/test_default_model.py` still compares tokenmill's
GGUF loader with transformers' own GGUF load.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.requirements import SMOLLM2_GGUF, require_smollm2


def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory shared by this run's xdist workers (their base temp's parent), or the base temp."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _load_from_gguf(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, gguf_file=SMOLLM2_GGUF, dtype="float32").eval()


@torch.inference_mode()
def _write_copy(model, out: Path) -> None:
    from transformers import AutoModelForCausalLM
    tmp = out.with_name(out.name + ".tmp")
    # transformers will not save a model it loaded from a GGUF: its weights (dequantized float32)
    # into a plain model of its config, as `tokenmill.benchmarks.bf16_deviation.load_hf` does.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(tmp)  # safetensors
    copy = AutoModelForCausalLM.from_pretrained(tmp, dtype="float32").eval()
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 314, 5099, 30]])
    assert torch.equal(copy(input_ids=ids).logits, model(input_ids=ids).logits), "the saved copy differs"
    os.replace(tmp, out)


def hf_smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The directory of HF's SmolLM2 (float32 safetensors + config), written by the first caller of
    this run (loading the GGUF); the others wait for it on a file lock."""
    from filelock import FileLock
    path = require_smollm2()
    out = run_dir(tmp_path_factory) / "hf-smollm2-float32"
    with FileLock(str(out) + ".lock"):
        if not out.is_dir():
            _write_copy(_load_from_gguf(path), out)
    return str(out)


def load_hf_smollm2(tmp_path_factory: pytest.TempPathFactory):
    """HF's SmolLM2 in float32 (eval mode), from this run's copy."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(hf_smollm2_dir(tmp_path_factory), dtype="float32").eval()
