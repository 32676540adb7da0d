"""Tile sizes of the fused MoE kernels, per (experts, hidden, intermediate, dtype, batch bucket).

Tables live next to this module as JSON (configs/E64_H2048_I1024_bfloat16.json, tuned by
`scripts/gpu_moe.py --parts tune` on an H100/H200): {"<batch bucket>": {"block_m": .., ...}}.
A batch of T tokens uses the smallest bucket >= T (the largest past the end). Shapes without a table get
`default_config`: small row blocks for decode-sized batches (little padding per expert), larger
ones for prefill.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class TileConfig:
    block_m: int = 16
    block_n: int = 64  # gate/up: intermediate columns per program
    block_k: int = 64  # gate/up: hidden per step
    down_block_n: int = 64  # down: hidden columns per program
    down_block_k: int = 64  # down: intermediate per step
    num_warps: int = 4
    num_stages: int = 3

    def to_json(self) -> dict:
        return asdict(self)


def config_file_name(num_experts: int, hidden: int, inter: int, dtype: str) -> str:
    return f"E{num_experts}_H{hidden}_I{inter}_{dtype}.json"


def default_config(num_pairs: int, num_experts: int) -> TileConfig:
    """Rows per expert on average decide the row block: decode batches spread over many experts."""
    rows_per_expert = num_pairs / max(num_experts, 1)
    if rows_per_expert <= 16:
        return TileConfig(block_m=16, block_n=64, block_k=128, down_block_n=64, down_block_k=128, num_warps=4)
    if rows_per_expert <= 64:
        return TileConfig(block_m=32, block_n=64, block_k=64, down_block_n=64, down_block_k=64, num_warps=4)
    return TileConfig(block_m=64, block_n=128, block_k=64, down_block_n=128, down_block_k=64, num_warps=8)


@functools.cache
def _table(name: str) -> dict[int, TileConfig] | None:
    path = CONFIG_DIR / name
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    return {int(bucket): TileConfig(**cfg) for bucket, cfg in raw.items()}


def tile_config(num_experts: int, hidden: int, inter: int, num_tokens: int, dtype: str, top_k: int) -> TileConfig:
    table = _table(config_file_name(num_experts, hidden, inter, dtype))
    if not table:
        return default_config(num_tokens * top_k, num_experts)
    buckets = sorted(table)
    bucket = next((b for b in buckets if b >= num_tokens), buckets[-1])
    return table[bucket]
