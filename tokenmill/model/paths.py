"""What a model path may be: a Hugging Face directory with config.json, or a .gguf file."""

from __future__ import annotations

import os


def is_gguf_file(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def check_model_path(path: str) -> None:
    """Raises ValueError unless `path` is a HF directory with config.json or a .gguf file."""
    if is_gguf_file(path) or os.path.isfile(os.path.join(path, "config.json")):
        return
    raise ValueError(f"model {path!r} is neither a directory containing config.json nor a .gguf file")
