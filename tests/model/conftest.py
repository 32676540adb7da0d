from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeps GGUF conversion caches out of the user's home (one cache for the whole session)."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tokenmill-cache"))
