"""NCCL settings for the TP group's large all-reduces (prefill chunks), set in a worker's
environment before its first communicator exists.

A prefill chunk of 8192 tokens all-reduces 64 MiB per o_proj and down_proj at Llama-8B's width;
NCCL carries those (the symmetric buffer's kernels are slower there). `TUNING` holds what
`scripts/gpu_layouts.py --parts arsweep` measured faster than NCCL's own choice, side by side on
the GPUs; a value the user set wins, and TOKENMILL_NCCL_TUNING=0 keeps NCCL's defaults (A/B runs).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

ENV_VAR = "TOKENMILL_NCCL_TUNING"
TUNING: dict[str, str] = {}


def apply(tp_size: int, environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set TUNING's variables the environment leaves unset, where TP > 1 and the tuning is not
    turned off; returns what was set."""
    if tp_size <= 1 or environ.get(ENV_VAR, "1").lower() in ("0", "false", "no"):
        return {}
    added = {k: v for k, v in TUNING.items() if k not in environ}
    environ.update(added)
    if added:
        logger.info("NCCL settings for the TP all-reduces: %s", ", ".join(f"{k}={v}" for k, v in added.items()))
    return added
