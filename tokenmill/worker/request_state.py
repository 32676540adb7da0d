"""The worker's mirror of one request, kept alive across steps from the scheduler's diffs."""

from __future__ import annotations

import torch

from tokenmill.protocol import NewRequestData, unpack_ids
from tokenmill.sampling_params import SamplingParams


class RequestState:
    """Invariant: `token_ids[:num_computed_tokens]` are in the KV cache at `block_ids`."""

    __slots__ = ("handle", "token_ids", "num_prompt_tokens", "params", "generator",
                 "block_ids", "num_computed_tokens")

    def __init__(self, data: NewRequestData, device: torch.device) -> None:
        self.handle = data.handle
        self.token_ids: list[int] = unpack_ids(data.token_ids)
        self.num_prompt_tokens = data.num_prompt_tokens
        self.params: SamplingParams = data.sampling_params
        self.block_ids: list[int] = unpack_ids(data.block_ids)
        self.num_computed_tokens = data.num_computed_tokens
        self.generator: torch.Generator | None = None
        if self.params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.params.seed)

    # The sampler's SamplingRow view.
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]
