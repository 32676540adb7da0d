"""LoRA adapters in the server: the registry of served names (`--lora-modules`, and at run time
`/v1/load_lora_adapter` / `/v1/unload_lora_adapter` with `--allow-runtime-lora-updating`), and
the `model` field resolved to an adapter.

Adapter ids are handed out here, never reused: an adapter unloaded and loaded again under the
same name is a new adapter to the engine (its prefix cache and slots key on the id)."""

from __future__ import annotations

import itertools

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.lora.peft import LoRAAdapterError, LoRANotFoundError
from tokenmill.lora.request import LoRARequest

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_int_id: int | None = None


class LoRARegistry:
    def __init__(self, frontend, base_name: str) -> None:
        self.frontend = frontend
        self.base_name = base_name
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter against the model and serve it as `name`; APIError 400/404 otherwise."""
        if self.frontend.config.lora is None:
            raise APIError(400, "LoRA adapters are not enabled: start the server with --enable-lora",
                           param="lora_name")
        if name == self.base_name or name in self.adapters:
            raise APIError(400, f"The lora adapter '{name[:200]}' has already been loaded.", param="lora_name")
        lora = LoRARequest(name, next(self._ids), path)
        try:
            self.frontend.lora_ref(lora)
        except LoRANotFoundError as exc:
            raise APIError(404, str(exc), param="lora_path", code="lora_not_found") from None
        except LoRAAdapterError as exc:
            raise APIError(400, str(exc), param="lora_path") from None
        self.adapters[name] = lora
        return lora

    def remove(self, name: str) -> None:
        lora = self.adapters.pop(name, None)
        if lora is None:
            raise APIError(404, f"The lora adapter '{name[:200]}' cannot be found.", param="lora_name",
                           code="lora_not_found")
        self.frontend.forget_lora(lora)  # requests already running with it finish with it

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for an unknown name."""
        if model is None or model == self.base_name:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            raise APIError(404, f"The model `{model[:200]}` does not exist.", param="model",
                           code="model_not_found")
        return lora


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
    request.app.state.tokenmill.loras.add(body.lora_name, body.lora_path)
    return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
    request.app.state.tokenmill.loras.remove(body.lora_name)
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")
