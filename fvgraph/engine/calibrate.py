"""Calibrating a step-caching method on an engine: one uncached run whose full steps the method reads.

`calibrate(engine, method, steps)` runs one request through the engine's own steps with the settings
the method's `Calibration` asks for, lets it observe every computed step's outputs, and (with a store)
saves what it measured for the loaded weights (fvgraph/caching/calibration_store.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from fvgraph.caching.calibration_store import CalibrationStore
from fvgraph.caching.methods import METHODS, settings_type
from fvgraph.request import Request

CALIBRATION_PROMPT = "a calibration run"


def calibrate(engine, method: str, steps: int, seed: int = 0, store: CalibrationStore | None = None,
              **request_fields) -> tuple[dict[str, Any], Path | None]:  # fmt: skip
    """Measure `method`'s calibrated settings with one `steps`-step request on `engine` (its loaded
    weights, its own step kinds; `request_fields` are Request fields such as prompt, guidance_scale,
    height, or prompt_embeds) and, with a `store`, save them for those weights. Returns (record, path)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not a known cache method; known methods: {', '.join(METHODS)}")
    calibration = settings_type(method).calibration()
    if calibration is None:
        raise ValueError(f"method={method!r} has nothing to calibrate")
    if "prompt" not in request_fields and "prompt_embeds" not in request_fields:
        request_fields["prompt"] = CALIBRATION_PROMPT
    request = Request(num_inference_steps=steps, seed=seed, output_type="latent", cache=calibration.settings(),
                      **request_fields)  # fmt: skip

    def observe(state, plan, outputs):
        if calibration.reads(plan.kind):
            calibration.observe(plan.step_index, outputs)

    began = time.perf_counter()
    with torch.no_grad():
        [result] = engine.generate([request], on_result=observe)
    if not result.ok:
        raise RuntimeError(f"calibration run {result.status}: {result.error}")
    components = engine.loop.components
    record = {
        "method": method, "card_id": engine.card.card_id, "weights_version": components.weights_version,
        "values": calibration.values(), "steps": steps, "seed": seed, "prompt": request_fields.get("prompt"),
        "latents_shape": list(result.latents.shape), "seconds": round(time.perf_counter() - began, 3),
    }  # fmt: skip
    path = None if store is None else store.save(engine.card.card_id, components.weights_version, method, record)
    return record, path
