"""L2 prefetch along an fp8 model's batch-1 weight chain (`triton_ops.l2_prefetch`).

A one-row decode step reads the fp8 linears in a fixed order: per decoder layer qkv, o, gate_up,
down, then the next layer's qkv, and at the end the LM head. Between some of them HBM idles:
attention over a short context sits between qkv and o; a norm and a kernel boundary sit between
o and gate_up, and between down and the next qkv. `link` gives each streaming fp8 linear the
next weight of the chain and how many of its first bytes to prefetch, so that the one-row GEMV
(`triton_fp8_stream`, rows == 1) asks L2 for them once its own weight reads are done; the next
GEMV then finds them in L2.

How much of each weight its predecessor prefetches is a `Plan`: from TOKENMILL_FP8_L2_PREFETCH,
e.g. `o=all,gate_up=16,down=0,qkv=8,head=8,mode=1` (MiB of the named weight; `all`: the whole
weight; absent names 0), `0`/`off` for none. The default is DEFAULT.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

ENV_VAR = "TOKENMILL_FP8_L2_PREFETCH"
KINDS = ("qkv", "o", "gate_up", "down", "head")
ALL = -1
DEFAULT = "off"


@dataclass(frozen=True)
class Plan:
    """MiB of each kind of weight prefetched by the linear before it (ALL: the whole weight)."""

    mib: tuple[tuple[str, int], ...] = ()
    mode: int = 1

    def bytes_for(self, kind: str, weight_bytes: int) -> int:
        mib = dict(self.mib).get(kind, 0)
        n = weight_bytes if mib == ALL else min(weight_bytes, mib << 20)
        return n // 4096 * 4096

    @classmethod
    def parse(cls, spec: str) -> "Plan | None":
        """None for off; a ValueError naming the item for a spec it cannot read."""
        spec = spec.strip().lower()
        if spec in ("", "0", "off", "no", "false"):
            return None
        from tokenmill.layers.triton_ops.l2_prefetch import MODES

        mib: dict[str, int] = {}
        mode = 1
        for item in spec.split(","):
            name, _, value = item.partition("=")
            name, value = name.strip(), value.strip()
            if name == "mode" and value.isdigit() and int(value) in MODES:
                mode = int(value)
            elif name in KINDS and (value == "all" or value.isdigit()):
                mib[name] = ALL if value == "all" else int(value)
            else:
                raise ValueError(f"{ENV_VAR}: cannot read {item!r} (names {', '.join(KINDS)} = MiB or 'all'; "
                                 f"mode = one of {sorted(MODES)})")
        return cls(tuple(sorted(mib.items())), mode)


@dataclass(frozen=True)
class Link:
    """What one linear prefetches: the first `nbytes` of `weight`."""

    weight: torch.Tensor
    nbytes: int
    mode: int

    def args(self) -> tuple[int, int, int]:
        return self.weight.data_ptr(), self.nbytes, self.mode


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


def plan_links(chain: list[tuple[str, nn.Module, torch.Tensor]], plan: Plan | None,
               usable) -> list[tuple[nn.Module, Link]]:
    """(module, its Link) for each pair of the chain where `usable(module, next_weight)` and the plan
    prefetches some of the next weight."""
    links = []
    for (_, module, _), (kind, _, weight) in zip(chain, chain[1:]):
        if plan is None or not usable(module, weight):
            continue
        nbytes = plan.bytes_for(kind, weight.numel() * weight.element_size())
        if nbytes:
            links.append((module, Link(weight, nbytes, plan.mode)))
    return links


def _usable(module: nn.Module, weight: torch.Tensor) -> bool:
    """A streaming fp8 linear, and a next weight on a CUDA device of compute capability 9.0+."""
    return _streams(module) and weight.is_cuda and torch.cuda.get_device_capability(weight.device) >= (9, 0)


def link(model: nn.Module, plan: Plan | None = None) -> int:
    """Give each streaming fp8 linear of the chain its `l2_prefetch` Link to the next weight (`plan`
    default: the environment's). Returns the links made."""
    plan = plan_from_env() if plan is None else plan
    chain = _chain(model)
    for _, module, _ in chain:
        module.__dict__.pop("l2_prefetch", None)
    links = plan_links(chain, plan, _usable)
    for module, link_ in links:
        module.__dict__["l2_prefetch"] = link_
    return len(links)


def prefetch_args(module: nn.Module, x: torch.Tensor) -> tuple[int, int, int] | None:
    """The GEMV's `prefetch` argument for this call: the module's link at one row, else None."""
    link_ = module.__dict__.get("l2_prefetch")
    if link_ is None or x.numel() != x.shape[-1]:
        return None
    return link_.args()
