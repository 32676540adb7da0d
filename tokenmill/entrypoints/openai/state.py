"""What the app's routes share, hung off `app.state.tokenmill` (no module globals)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from starlette.requests import Request

from tokenmill.entrypoints.openai.admission import Admission
from tokenmill.entrypoints.openai.args import ServerSettings
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.entrypoints.openai.lora_routes import LoRARegistry
from tokenmill.frontend.engine_frontend import EngineFrontend
from tokenmill.lora.request import LoRARequest


@dataclass
class ServerState:
    engine: AsyncLLM
    settings: ServerSettings
    admission: Admission
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    started: int = field(default_factory=lambda: int(time.time()))
    loras: LoRARegistry | None = None  # served LoRA adapters by name (set by build_app)

    @property
    def frontend(self) -> EngineFrontend:
        """Where requests are prepared (checked), once, before they are generated."""
        return self.engine.frontend

    @property
    def tokenizer(self):
        return self.frontend.tokenizer

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); 404 for a name not served."""
        if self.loras is not None:
            return self.loras.resolve(model)
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model[:200]}` does not exist.", param="model",
                           code="model_not_found")
        return None

    def response_model(self, lora: LoRARequest | None) -> str:
        """The `model` a response names: the adapter's name, or the served model's."""
        return self.model_name if lora is None else lora.lora_name


def get_state(request: Request) -> ServerState:
    return request.app.state.tokenmill
