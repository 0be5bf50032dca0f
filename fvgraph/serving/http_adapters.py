"""The adapter admin endpoints of the HTTP API, behind the same API key as every /v1 route.

    GET    /v1/loras           {"object": "list", "data": [{"name", "path", "digest", "rank", "modules", "slot", ...}]}
    POST   /v1/loras           {"name": "style", "path": "/models/style.safetensors"}: load into a free slot
                               (+ "expert": "transformer" | "transformer_2" on a two-expert card)
    DELETE /v1/loras/{name}    unload; 409 while a request in flight uses it

`path` names a file in the operator's adapter directory (`fvgraph serve --lora-dir DIR`), relative
to it; without one, loading over HTTP is refused. A path that leaves the directory (after links are
resolved) or names no file gets one answer either way, and nothing outside is opened: the endpoint
tells nothing of the rest of the disk, and the list shows names, not paths. The file is read on a
worker thread (a slow disk stalls no step); the slot is written on the engine thread between two
ticks (AsyncEngine.call), so a step never reads a slot while it is written. Requests then choose
adapters with the body's `loras`.

On a two-expert card (Wan 2.2 A14B) `expert` names the denoiser the adapter loads into, by diffusers'
component names: "transformer" (high noise; the default, as diffusers' `load_lora_weights` without
`load_into_transformer_2`) or "transformer_2" (low noise). A one-denoiser card refuses the field.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Literal

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
    expert: Literal["transformer", "transformer_2"] | None = Field(
        default=None, description="A two-expert card's denoiser: 'transformer' (high noise, the default) or 'transformer_2'.")


class AdapterApi:
    def __init__(self, served: AsyncEngine, lora_dir: Path | None):
        self.served = served
        self.lora_dir = None if lora_dir is None else Path(lora_dir).resolve()

    async def list_loras(self):
        data = await self.served.call(lambda engine: engine.loras())
        return {"object": "list", "data": [{"object": "lora", **_without_path(adapter)} for adapter in data]}

    def _file(self, given: str) -> Path:
        """The adapter file `given` names inside the adapter directory; one 404 for outside and missing."""
        if self.lora_dir is None:
            raise ApiError(403, "loading adapters over HTTP needs an adapter directory: start the server with "
                                "--lora-dir DIR and name files in it", "path", "lora_dir_unset")  # fmt: skip
        absent = ApiError(404, f"no adapter file {given[:200]!r} in the server's adapter directory", "path", "not_found")
        path = (self.lora_dir / given).resolve()
        try:
            if not path.is_relative_to(self.lora_dir) or not path.is_file():
                raise absent
        except OSError:  # a name too long to stat: the same answer
            raise absent from None
        return path

    async def load_lora(self, http: HttpRequest):
        try:
            body = LoadLora.model_validate(json_fields(await http.body()))
        except ValidationError as err:
            first = err.errors()[0]
            name = str(first["loc"][-1]) if first.get("loc") else "body"
            raise ApiError(400, f"{name}: {first['msg']}", name, "invalid_value") from None
        path = self._file(body.path)
        try:
            weights = await asyncio.to_thread(self.served.engine.read_lora, body.name, path, body.expert)
            adapter = await self.served.call(lambda engine: engine.load_lora(body.name, weights, body.expert))
        except AdapterError as err:
            raise ApiError(400, str(err), _param_of(str(err)), "invalid_value") from None
        return {"object": "lora", **_without_path(adapter)}

    async def unload_lora(self, name: str):
        try:
            adapter = await self.served.call(lambda engine: engine.unload_lora(name))
        except AdapterError as err:
            status, code = (404, "not_found") if "unknown lora" in str(err) else (409, "lora_in_use") if "in use" in str(err) else (400, "invalid_value")
            raise ApiError(status, str(err), "name", code) from None
        return {"object": "lora.deleted", "name": adapter["name"], "deleted": True}


def _param_of(message: str) -> str:
    """The body field an AdapterError's message is about."""
    if message.startswith("expert="):
        return "expert"
    return "path" if "path" in message or "lora key" in message else "name"


def _without_path(adapter: dict) -> dict:
    return {key: value for key, value in adapter.items() if key != "path"}


ADAPTER_ROUTES = [("GET", "/v1/loras", "list_loras"), ("POST", "/v1/loras", "load_lora"), ("DELETE", "/v1/loras/{name}", "unload_lora")]
