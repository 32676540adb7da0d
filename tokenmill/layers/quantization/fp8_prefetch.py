"""L2 prefetch along an fp8 model's batch-1 weight chain (`triton_ops.l2_prefetch`).

A one-row decode step reads the fp8 linears in a fixed order: per decoder layer qkv, o, gate_up,
down, then the next layer's qkv, and at the end the LM head. Between some of them HBM idles:
attention over a short context sits between qkv and o; a norm and a kernel boundary sit between
o and gate_up, and between down and the next qkv. `link` gives each streaming fp8 linear up to two
byte ranges of the weights after it, which its one-row GEMV (`triton_fp8_stream`, rows == 1) asks
L2 to fetch once its own weight reads are done; the GEMVs after it then find them in L2.

The ranges come from a `Plan`: how far ahead of its own end each kind of linear wants the chain in
L2 (MiB of the chain's weights laid end to end, from the end of its own weight). A linear
prefetches from the furthest byte already asked for (or its own end) up to that point, so nothing
is asked for twice. TOKENMILL_FP8_L2_PREFETCH, e.g. `qkv=32,o=32,gate_up=4,down=8,mode=1` (absent
names: 0), `0`/`off` for none; the default is DEFAULT.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

ENV_VAR = "TOKENMILL_FP8_L2_PREFETCH"
KINDS = ("qkv", "o", "gate_up", "down", "head")
DEFAULT = "off"
MAX_RANGES = 2  # byte ranges one GEMV prefetches (the kernel's pf_addr / pf_addr2)


@dataclass(frozen=True)
class Plan:
    """MiB of the chain each kind of linear wants in L2 ahead of its own end."""

    ahead_mib: tuple[tuple[str, int], ...] = ()
    mode: int = 1

    def ahead(self, kind: str) -> int:
        return dict(self.ahead_mib).get(kind, 0) << 20

    @classmethod
    def parse(cls, spec: str) -> "Plan | None":
        """None for off; a ValueError naming the item for a spec it cannot read."""
        spec = spec.strip().lower()
        if spec in ("", "0", "off", "no", "false"):
            return None
        from tokenmill.layers.triton_ops.l2_prefetch import MODES

        ahead: dict[str, int] = {}
        mode = 1
        for item in spec.split(","):
            name, _, value = item.partition("=")
            name, value = name.strip(), value.strip()
            if name == "mode" and value.isdigit() and int(value) in MODES:
                mode = int(value)
            elif name in KINDS and value.isdigit():
                ahead[name] = int(value)
            else:
                raise ValueError(f"{ENV_VAR}: cannot read {item!r} (names {', '.join(KINDS)} = MiB ahead; "
                                 f"mode = one of {sorted(MODES)})")
        return cls(tuple(sorted(ahead.items())), mode)


@dataclass(frozen=True)
class Link:
    """What one linear prefetches: up to MAX_RANGES (weight, first byte, bytes) ranges."""

    ranges: tuple[tuple[torch.Tensor, int, int], ...]
    mode: int

    def args(self) -> tuple[int, int, int, int, int]:
        """(address, bytes, address 2, bytes 2, mode) for `fp8_stream_gemm`'s `prefetch`."""
        flat = [(w.data_ptr() + lo, n) for w, lo, n in self.ranges]
        flat += [(flat[0][0], 0)] * (MAX_RANGES - len(flat))  # (an address all the same: one compiled variant)
        return flat[0][0], flat[0][1], flat[1][0], flat[1][1], self.mode


def plan_from_env() -> Plan | None:
    return Plan.parse(os.environ.get(ENV_VAR, DEFAULT))


def _chain(model: nn.Module) -> list[tuple[str, nn.Module, torch.Tensor]]:
    """(kind, module, weight) in a one-row step's order: each decoder layer's four linears, then
    the 8-bit LM head if there is one (`lm_head_8bit`)."""
    chain = []
    for module in model.modules():
        attn, mlp = getattr(module, "self_attn", None), getattr(module, "mlp", None)
        four = [("qkv", getattr(attn, "qkv_proj", None)), ("o", getattr(attn, "o_proj", None)),
                ("gate_up", getattr(mlp, "gate_up_proj", None)), ("down", getattr(mlp, "down_proj", None))]
        if all(m is not None and isinstance(getattr(m, "weight", None), torch.Tensor) for _, m in four):
            chain += [(kind, m, m.weight) for kind, m in four]
    head = getattr(getattr(model, "logits_head", None), "head_8bit", None)
    if head is not None and chain:
        chain.append(("head", head, head.weight))
    return chain


def _streams(module: nn.Module) -> bool:
    from tokenmill.layers.quantization.fp8 import Fp8LinearMethod

    return isinstance(getattr(module, "quant_method", None), Fp8LinearMethod) and \
        getattr(module, "stream_counters", None) is not None


def _nbytes(w: torch.Tensor) -> int:
    return w.numel() * w.element_size()


def plan_links(chain: list[tuple[str, nn.Module, torch.Tensor]], plan: Plan | None,
               usable) -> list[tuple[nn.Module, Link]]:
    """(module, its Link) for each linear of the chain that `usable(module)` and whose plan asks for
    bytes beyond what the linears before it asked for. Ranges start and end on 4 KiB boundaries
    inside one weight each."""
    if plan is None:
        return []
    starts, total = [], 0
    for _, _, w in chain:
        starts.append(total)
        total += _nbytes(w)
    links, frontier = [], 0
    for i, (kind, module, w) in enumerate(chain[:-1]):
        end = starts[i] + _nbytes(w)
        lo, hi = max(frontier, end), min(end + plan.ahead(kind), total)
        if hi <= lo or not usable(module):
            continue
        frontier = hi
        ranges = []
        for j in range(i + 1, len(chain)):
            w_lo, w_hi = starts[j], starts[j] + _nbytes(chain[j][2])
            a = -(-(max(lo, w_lo) - w_lo) // 4096) * 4096
            b = (min(hi, w_hi) - w_lo) // 4096 * 4096
            if b > a and len(ranges) < MAX_RANGES:
                ranges.append((chain[j][2], a, b - a))
        if ranges:
            links.append((module, Link(tuple(ranges), plan.mode)))
    return links


def _usable(module: nn.Module) -> bool:
    """A streaming fp8 linear on a CUDA device of compute capability 9.0+."""
    return _streams(module) and module.weight.is_cuda and \
        torch.cuda.get_device_capability(module.weight.device) >= (9, 0)


def link(model: nn.Module, plan: Plan | None = None) -> int:
    """Give each streaming fp8 linear of the chain its `l2_prefetch` Link (`plan` default: the
    environment's). Returns the links made."""
    plan = plan_from_env() if plan is None else plan
    chain = _chain(model)
    for _, module, _ in chain:
        module.__dict__.pop("l2_prefetch", None)
    links = plan_links(chain, plan, _usable)
    for module, link_ in links:
        module.__dict__["l2_prefetch"] = link_
    return len(links)


def prefetch_args(module: nn.Module, x: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    """The GEMV's `prefetch` argument for this call: the module's link at one row, else None."""
    link_ = module.__dict__.get("l2_prefetch")
    if link_ is None or x.numel() != x.shape[-1]:
        return None
    return link_.args()
