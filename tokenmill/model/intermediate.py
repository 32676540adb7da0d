"""What one pipeline stage hands the next: the residual stream after its last layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class IntermediateTensors:
    hidden: torch.Tensor  # [T, hidden]
    residual: torch.Tensor | None  # [T, hidden] where the fused kernels keep it apart (CUDA); else None

    def tensors(self) -> list[torch.Tensor]:
        return [self.hidden] if self.residual is None else [self.hidden, self.residual]

    @staticmethod
    def of(tensors: list[torch.Tensor]) -> IntermediateTensors:
        return IntermediateTensors(tensors[0], tensors[1] if len(tensors) > 1 else None)
