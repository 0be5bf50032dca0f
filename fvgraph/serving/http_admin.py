"""The engine's sleep and wake over HTTP, behind the same API key as every /v1 route (HttpGuard).

    POST /v1/admin/sleep   {"level": 1 | 2, "in_flight": "finish" | "stop" | "refuse"}   ("finish" when left out)
    POST /v1/admin/wake    (no body)

Sleep takes the denoiser's weights off the device (level 1: to host memory; 2: discarded; Engine.sleep,
fvgraph/engine/sleep.py) once the requests in flight have ended as `in_flight` says; from the moment
it is asked, new video and image requests get 503 naming sleep, until wake returns. Sleeping twice is
a 409; waking an awake engine answers 200 and changes nothing.
"""

from __future__ import annotations

from typing import Literal

from fastapi import Request as HttpRequest
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError, field_validator

from fvgraph.engine.sleep import EngineAsleep, RequestsInFlight
from fvgraph.serving.async_engine import AsyncEngine
from fvgraph.serving.http_errors import ApiError
from fvgraph.serving.openai_requests import json_fields


class SleepBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    level: StrictInt  # strict: neither "1" nor true
    in_flight: Literal["finish", "stop", "refuse"] = "finish"

    @field_validator("level")
    @classmethod
    def _one_or_two(cls, level: int) -> int:
        if level not in (1, 2):
            raise ValueError(f"{level} must be 1 (weights to host memory) or 2 (weights discarded)")
        return level


class AdminApi:
    def __init__(self, served: AsyncEngine):
        self.served = served

    async def sleep(self, http: HttpRequest):
        try:
            body = SleepBody.model_validate(json_fields(await http.body()))
        except ValidationError as err:
            first = err.errors()[0]
            name = str(first["loc"][0]) if first.get("loc") else "body"
            raise ApiError(400, f"{name}: {first['msg']}", name, "invalid_value") from None
        try:
            answer = await self.served.sleep(body.level, body.in_flight)
        except (EngineAsleep, RequestsInFlight) as err:  # asleep already, or in_flight="refuse" with requests in flight
            raise ApiError(409, str(err), "level" if isinstance(err, EngineAsleep) else "in_flight", "conflict") from None
        except ValueError as err:  # refused by the engine: parallel, offload, merged adapters at level 2
            raise ApiError(400, str(err), "level", "invalid_value") from None
        return {"object": "engine.sleep", **answer}

    async def wake(self):
        answer = await self.served.wake()
        return {"object": "engine.wake", **answer}


ADMIN_ROUTES = [("POST", "/v1/admin/sleep", "sleep"), ("POST", "/v1/admin/wake", "wake")]
