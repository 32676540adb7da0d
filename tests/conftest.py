"""Session-wide fixtures: the real default model, loaded once (skipped when its package is absent,
a failure when CI is set: tests/helpers/requirements.py)."""

from __future__ import annotations

import os
import shutil

# Without a GPU, Triton kernels run in Triton's interpreter. Triton reads this when it is first
# imported, and transformers may import it while any test module is collected: set it first.
if not os.path.exists("/dev/nvidia0") and shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.helpers.requirements import SMOLLM2_GGUF, require_smollm2  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_llm():
    require_smollm2()
    from tokenmill import LLM
    # In-process, so tests can inspect the scheduler (llm.engine.scheduler).
    return LLM("smollm2", dtype="float32", max_model_len=2048, kv_cache_memory_gb=0.5, single_process=True)


@pytest.fixture(scope="session")
def smollm2_hf():
    path = require_smollm2()
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, gguf_file=SMOLLM2_GGUF, dtype="float32").eval()


@pytest.fixture(autouse=True)
def _kv_pool_is_free_after_each_test(request):
    """Every test that used the shared engine must leave every KV block free."""
    yield
    if "smollm2_llm" in request.fixturenames:
        stats = request.getfixturevalue("smollm2_llm").kv_cache_stats()
        assert stats["num_requests"] == 0, f"{stats['num_requests']} requests left in the engine"
        assert stats["num_free_blocks"] == stats["num_blocks"], f"KV blocks leaked: {stats}"
