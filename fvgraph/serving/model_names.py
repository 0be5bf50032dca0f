"""The names a request's `model` may give, and `GET /v1/models`, which lists them.

    served card id      always ("tiny-wan", "wan2.1-t2v-1.3b")
    aliases             `fvgraph serve --served-model-name NAME` (repeatable, as vLLM's flag)
    the checkpoint      a Hub repo id as given, or the id of the Hub-cache snapshot a folder is
                        (huggingface_hub's cache scan names it): "ORG/NAME"; from a plain folder
                        NAME: "NAME", and "ORG/NAME" for any ORG (a folder does not say which
                        organisation published it)

OpenAI's own names (`sora-2`, `gpt-image-1`) are not served names: a deployment that wants clients
written for OpenAI to work unchanged gives them as aliases. A name is matched exactly (case too).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from fvgraph.models.hub_checkpoint import hub_repo_id_of, looks_like_repo_id
from fvgraph.request import RequestRejected
from fvgraph.serving.http_errors import ApiError

MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class ServedNames:
    card_id: str
    aliases: tuple[str, ...] = ()
    checkpoint: str | None = None  # "ORG/NAME" (a repo id, or a Hub-cache snapshot) or a plain folder's NAME
    created: int = field(default_factory=lambda: int(time.time()))  # what /v1/models reports as `created`

    def __post_init__(self):
        for name in self.aliases:
            if not name or len(name) > MAX_NAME_CHARS or any(c.isspace() or not c.isprintable() for c in name):
                raise ValueError(f"--served-model-name={name!r} must be 1 to {MAX_NAME_CHARS} printable characters "
                                 "without spaces")  # fmt: skip

    @classmethod
    def of(cls, card_id: str, aliases: list[str] | tuple[str, ...] = (), checkpoint: str | Path | None = None) -> ServedNames:
        return cls(card_id, tuple(dict.fromkeys(aliases)), None if checkpoint is None else checkpoint_name(checkpoint))

    @property
    def listed(self) -> list[str]:
        """The names /v1/models lists: the card id, the aliases, the checkpoint's name."""
        return list(dict.fromkeys([self.card_id, *self.aliases, *([self.checkpoint] if self.checkpoint else [])]))

    def accepts(self, model: str) -> bool:
        if model in self.listed:
            return True
        org, slash, name = model.partition("/")
        return bool(slash and org and self.checkpoint and "/" not in self.checkpoint and name == self.checkpoint)

    def check(self, model: str | None) -> None:
        """Refuse a `model` that names nothing served here (none given: the served card)."""
        if model is not None and not self.accepts(model):
            served = ", ".join(repr(name) for name in self.listed)
            raise RequestRejected("model", f"{model[:MAX_NAME_CHARS]!r} is not served here; this server serves {served} "
                                           "(GET /v1/models lists them; --served-model-name adds names)")  # fmt: skip


def checkpoint_name(checkpoint: str | Path) -> str:
    """The repository id a checkpoint stands for: a Hub repo id as given; for a folder, the id of the
    Hub-cache snapshot it is (or is inside), else the folder's own name."""
    if looks_like_repo_id(str(checkpoint)):
        return str(checkpoint)
    path = Path(checkpoint)
    return hub_repo_id_of(path) or path.resolve().name


class ModelsApi:
    """GET /v1/models and GET /v1/models/{model} in OpenAI's shape (behind the API key as every /v1 route)."""

    def __init__(self, names: ServedNames):
        self.names = names

    def _model(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.names.created, "owned_by": "fvgraph"}

    async def list_models(self):
        return {"object": "list", "data": [self._model(name) for name in self.names.listed]}

    async def get_model(self, model: str):
        if not self.names.accepts(model):
            raise ApiError(404, f"model {model[:MAX_NAME_CHARS]!r} is not served here; GET /v1/models lists the served names",
                           "model", "model_not_found")  # fmt: skip
        return self._model(model)


MODEL_ROUTES = [("GET", "/v1/models", "list_models"), ("GET", "/v1/models/{model:path}", "get_model")]
