"""On-disk cache of what transformers derives slowly from a GGUF file (config, tokenizer).

One directory per GGUF file, keyed by its absolute path, size and mtime, under
$TOKENMILL_CACHE_DIR or ~/.cache/tokenmill. Entries are written to a temporary
directory and renamed into place, so readers never see a half-written entry.
Only JSON/text files are stored (written by `save_pretrained`), never pickles.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    env = os.environ.get("TOKENMILL_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tokenmill"


def entry_dir(gguf_path: str, kind: str) -> Path:
    """The cache directory for `kind` ("config", "tokenizer") derived from `gguf_path`."""
    path = os.path.abspath(gguf_path)
    st = os.stat(path)
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:24]
    return cache_root() / f"gguf-{key}" / kind


def get_or_create(gguf_path: str, kind: str, write: Callable[[Path], None]) -> Path | None:
    """Returns the entry directory, calling `write(tmpdir)` to fill it on a miss.

    Returns None when the cache cannot be written (read-only home, ...): callers then
    fall back to the uncached path.
    """
    final = entry_dir(gguf_path, kind)
    if final.is_dir():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{kind}-"))
    except OSError:
        return None
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, final)
    except OSError:
        # Another process won the race (final exists), or the disk refused: use what is there.
        shutil.rmtree(tmp, ignore_errors=True)
        return final if final.is_dir() else None
    return final
