"""`python -m tokenmill` is the `tokenmill` command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parent.parent)


def test_python_m_tokenmill_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "tokenmill", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: tokenmill") and all(c in proc.stdout for c in ("generate", "serve", "bench"))
    proc = subprocess.run([sys.executable, "-m", "tokenmill", "generate", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0 and all(f in proc.stdout for f in ("--revision", "--download-dir", "--gguf-file",
                                                                   "--tokenizer"))
