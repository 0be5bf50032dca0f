"""The playground: a page at `/` that drives the public videos API from a browser, and what it reads.

    GET    /                          the page (fvgraph/serving/playground/index.html), open without a key
    GET    /v1/playground/config      the served card: its id, defaults, limits, the step-caching methods

The page is static: plain HTML with one inline script and one inline style, no framework and no
other origin. It asks only the public API (this config, POST /v1/videos, the video's events and
content) with the key a person types in, so it can do nothing a client with that key could not. Its
Content-Security-Policy allows exactly its own inline script and style (by hash), requests to this
origin, and blob URLs for the fetched video, so a page that reached for anything else would fail in
the browser. `fvgraph serve --no-playground` (HttpSettings.playground=False) serves neither route.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from fastapi.responses import HTMLResponse

from fvgraph.serving.async_engine import AsyncEngine
from fvgraph.serving.media_encode import MAX_FPS, MIN_FPS
from fvgraph.serving.openai_requests import DEFAULT_FPS, SEED_RANGE

PAGE = "index.html"
GUIDANCE_RANGE = (0.0, 30.0)  # what POST /v1/videos takes (openai_requests._Body.guidance_scale)


class PlaygroundApi:
    """The page, read once from the package, and the card facts it shows."""

    def __init__(self, served: AsyncEngine, max_prompt_chars: int):
        self.served, self.max_prompt_chars = served, max_prompt_chars
        self.html = resources.files("fvgraph.serving").joinpath("playground", PAGE).read_text(encoding="utf-8")
        self.policy = content_security_policy(self.html)

    async def page(self):
        headers = {"Content-Security-Policy": self.policy, "X-Content-Type-Options": "nosniff",
                   "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}  # fmt: skip
        return HTMLResponse(self.html, headers=headers)

    async def config(self):
        """What the form needs: the card's defaults and limits, and the methods a request may pick."""
        engine = self.served.engine
        card, loop, facts = engine.card, engine.loop, engine.facts
        rules, recipe = card.shapes, card.recipe
        admitted = recipe.step_caching  # the weights' own list (None: every method)
        methods = [m for m in loop.step_caching_methods if admitted is None or m in admitted]
        default_cache = card.default_cache.method if card.default_cache is not None else None
        return {
            "object": "playground.config",
            "model": card.card_id,
            "loop": loop.loop_id,
            "takes_image": "image" in loop.reads,
            "defaults": {
                "width": rules.default_width, "height": rules.default_height, "num_frames": rules.default_frames,
                "num_inference_steps": recipe.default_steps, "guidance_scale": recipe.default_guidance_scale,
                "fps": DEFAULT_FPS, "cache": default_cache if default_cache in methods else "none",
            },
            "limits": {
                "max_width": rules.max_width, "max_height": rules.max_height, "max_frames": rules.max_frames,
                "spatial_multiple": facts.spatial_multiple, "temporal_multiple": facts.temporal_multiple,
                "num_inference_steps": list(recipe.allowed_steps), "guidance_scale": list(GUIDANCE_RANGE),
                "fps": [MIN_FPS, MAX_FPS], "seed": [0, SEED_RANGE - 1], "max_prompt_chars": self.max_prompt_chars,
            },
            "cache_methods": methods,
        }  # fmt: skip


PLAYGROUND_ROUTES = [("GET", "/", "page"), ("GET", "/v1/playground/config", "config")]
_INLINE = {"script": re.compile(r"<script>(.*?)</script>", re.S), "style": re.compile(r"<style>(.*?)</style>", re.S)}


def content_security_policy(html: str) -> str:
    """A policy that runs the page's own inline <script> and <style> blocks (by their sha256), fetches
    from this origin only, and plays blob URLs: nothing else loads or runs."""
    hashes = {}
    for kind, pattern in _INLINE.items():
        digests = [base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() for body in pattern.findall(html)]
        hashes[kind] = " ".join(f"'sha256-{digest}'" for digest in digests) or "'none'"
    return (f"default-src 'none'; script-src {hashes['script']}; style-src {hashes['style']}; connect-src 'self'; "
            "media-src blob:; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")  # fmt: skip
