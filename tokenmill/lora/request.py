"""`LoRARequest`: which adapter a request runs with (vLLM's names and argument order)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.protocol import LoRARef


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: a name, an integer id (>= 1, unique per adapter) and a PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"lora_path of adapter {self.lora_name!r} must be a PEFT adapter folder")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

    def ref(self) -> LoRARef:
        """What travels to the engine core with the request."""
        return LoRARef(self.lora_int_id, self.lora_name, self.lora_path)
