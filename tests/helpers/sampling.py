"""Sampler test helpers: a SamplingState and its Sampler driven as a model runner would, and the
logit adjustments written out from their definitions (the reference the device code must match)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tokenmill.layers.sampling import Sampler, SamplerOutput, SamplingState
from tokenmill.sampling_params import SamplingParams

# Every sampler test runs on the CPU, and on CUDA too where there is one.
DEVICES = [pytest.param("cpu")] + ([pytest.param("cuda")] if torch.cuda.is_available() else [])

# Ops that read device data on the host, or make shapes depend on it.
SYNCING_OPS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero"}


class OpLog(TorchDispatchMode):
    """Counts the ATen ops dispatched inside it, and the largest tensor an op allocated (outputs
    that alias an input, views and in-place results, are not allocations)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.largest_allocation = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest_allocation = max(self.largest_allocation, t.numel())
        return out


@contextlib.contextmanager
def no_host_sync(device: torch.device):
    """On CUDA, any host sync inside raises (torch's sync debug mode); elsewhere a no-op."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class Harness:
    def __init__(self, device: str, vocab_size: int, max_slots: int = 8, eos: Sequence[int] = ()) -> None:
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.state = SamplingState(max_slots, vocab_size, eos, self.device)
        self.sampler = Sampler(self.state)
        self.scratch = self.state.scratch_slot

    def add(self, slot: int, params: SamplingParams | None = None, prompt: Sequence[int] = (),
            outputs: Sequence[int] = ()) -> int:
        self.state.add(slot, params or SamplingParams(), prompt, outputs)
        return slot

    def remove(self, slot: int) -> None:
        self.state.remove(slot)

    def slots(self, slots: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(slots), dtype=torch.int64, device=self.device)

    def run(self, logits: torch.Tensor, slots: Sequence[int], record: bool = True) -> SamplerOutput:
        return self.sampler.sample(logits.to(self.device), self.slots(slots), record=record)

    def sample(self, logits: torch.Tensor, slots: Sequence[int], record: bool = True) -> list[int]:
        return self.run(logits, slots, record).sampled.tolist()

    def adjusted(self, logits: torch.Tensor, slots: Sequence[int]) -> torch.Tensor:
        return self.sampler.adjusted_logits(logits.to(self.device), self.slots(slots)).cpu()


def reference_adjusted(logits: list[float], params: SamplingParams, prompt: list[int], outputs: list[int],
                       eos: list[int]) -> list[float]:
    """The adjustments written out token by token, from their definitions."""
    out = list(logits)
    for t, b in (params.logit_bias or {}).items():
        out[t] += b
    if len(outputs) < params.min_tokens:
        for t in set(eos) | set(params.stop_token_ids or ()):
            out[t] = -float("inf")
    p = params.repetition_penalty
    for t in set(prompt) | set(outputs):  # HF: divide positive logits, multiply the others
        out[t] = out[t] / p if out[t] > 0 else out[t] * p
    for t in set(outputs):  # OpenAI: count * frequency + presence, over output tokens only
        out[t] -= outputs.count(t) * params.frequency_penalty + params.presence_penalty
    return out
