"""The adapter admin endpoints of the HTTP API, behind the same API key as every /v1 route.

    GET    /v1/loras           {"object": "list", "data": [{"name", "path", "digest", "rank", "modules", "slot", ...}]}
    POST   /v1/loras           {"name": "style", "path": "/models/style.safetensors"}: load into a free slot
    DELETE /v1/loras/{name}    unload; 409 while a request in flight uses it

`path` is a file on the server's own disk: loading is an operator's action, as with SGLang's
set_lora. Each change runs on the engine thread between two ticks (AsyncEngine.call), so a step
never reads a slot while it is written. Requests then choose adapters with the body's `loras`.
"""

from __future__ import annotations

from fastapi import Request as HttpRequest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fvgraph.adapters.lora_file import AdapterError
from fvgraph.serving.async_engine import AsyncEngine
from fvgraph.serving.http_errors import ApiError
from fvgraph.serving.openai_requests import json_fields


class LoadLora(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    path: str = Field(min_length=1, max_length=4096, description="A LoRA file on the server's disk.")


class AdapterApi:
    def __init__(self, served: AsyncEngine):
        self.served = served

    async def list_loras(self):
        data = await self.served.call(lambda engine: engine.loras())
        return {"object": "list", "data": [{"object": "lora", **adapter} for adapter in data]}

    async def load_lora(self, http: HttpRequest):
        try:
            body = LoadLora.model_validate(json_fields(await http.body()))
        except ValidationError as err:
            first = err.errors()[0]
            name = str(first["loc"][-1]) if first.get("loc") else "body"
            raise ApiError(400, f"{name}: {first['msg']}", name, "invalid_value") from None
        try:
            adapter = await self.served.call(lambda engine: engine.load_lora(body.name, body.path))
        except AdapterError as err:
            raise ApiError(400, str(err), "path" if "path" in str(err) or "lora key" in str(err) else "name", "invalid_value") from None
        return {"object": "lora", **adapter}

    async def unload_lora(self, name: str):
        try:
            adapter = await self.served.call(lambda engine: engine.unload_lora(name))
        except AdapterError as err:
            status, code = (404, "not_found") if "unknown lora" in str(err) else (409, "lora_in_use") if "in use" in str(err) else (400, "invalid_value")
            raise ApiError(status, str(err), "name", code) from None
        return {"object": "lora.deleted", "name": adapter["name"], "deleted": True}


ADAPTER_ROUTES = [("GET", "/v1/loras", "list_loras"), ("POST", "/v1/loras", "load_lora"), ("DELETE", "/v1/loras/{name}", "unload_lora")]
