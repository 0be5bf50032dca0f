"""Calibrated cache settings: measured once per model by `fvgraph calibrate`, found again by weights.

Some methods' settings are calibrated per model (MagCache's `mag_ratios`). `calibrate(engine, method,
steps)` runs one uncached request through the engine's own steps and lets the method's `Calibration`
read every full step's outputs; `CalibrationStore` keeps the result as JSON at

    <root>/<card_id>/<weights_version>/<method>.json

`weights_version` is the loaded weights' fingerprint (seeded weights: a hash of their bytes; a
checkpoint folder: its files' names, sizes, modification times and safetensors headers), so ratios
measured on one checkpoint are never found for another (nor for the same folder after its files are
rewritten). The store lives beside the capture cache, not in the checkpoint folder: a checkpoint may
be read-only, and a file added there would change its fingerprint. The root defaults to
`capture_cache/calibration` (relative to the working directory), or `<cache_dir>/calibration` when an
engine has a capture cache dir.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fvgraph.loops.interceptor import METHODS, settings_type

DEFAULT_CALIBRATION_DIR = Path("capture_cache") / "calibration"
CALIBRATION_PROMPT = "a calibration run"


def calibration_root(calibration_dir: str | Path | None, cache_dir: str | Path | None) -> Path:
    """The store root an engine uses: `calibration_dir`, else `<cache_dir>/calibration`, else the default."""
    if calibration_dir is not None:
        return Path(calibration_dir)
    return Path(cache_dir) / "calibration" if cache_dir is not None else DEFAULT_CALIBRATION_DIR


class CalibrationStore:
    """Calibrated settings on disk, one JSON file per (card, weights, method)."""

    def __init__(self, root: str | Path = DEFAULT_CALIBRATION_DIR):
        self.root = Path(root)

    def path(self, card_id: str, weights_version: str, method: str) -> Path:
        return self.root / card_id / weights_version / f"{method}.json"

    def load(self, card_id: str, weights_version: str, method: str) -> dict[str, Any] | None:
        """The stored record ({"values": {...}, "steps", "seed", ...}) or None when none was measured."""
        path = self.path(card_id, weights_version, method)
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text())
        except ValueError as err:
            raise ValueError(f"calibration file {path} is not JSON ({err}); rerun `fvgraph calibrate`") from None
        if not isinstance(record, dict) or not isinstance(record.get("values"), dict):
            raise ValueError(f"calibration file {path} has no 'values' object; rerun `fvgraph calibrate`")
        return record

    def save(self, card_id: str, weights_version: str, method: str, record: dict[str, Any]) -> Path:
        """Write `record` atomically (a reader never sees half a file)."""
        path = self.path(card_id, weights_version, method)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".calibration-", delete=False) as handle:
            json.dump(record, handle, indent=1)
        os.replace(handle.name, path)
        return path


def calibrate(engine, method: str, steps: int, seed: int = 0, store: CalibrationStore | None = None,
              **request_fields) -> tuple[dict[str, Any], Path | None]:  # fmt: skip
    """Measure `method`'s calibrated settings with one `steps`-step request on `engine` (its loaded
    weights, its own step kinds; `request_fields` are Request fields such as prompt, guidance_scale,
    height, or prompt_embeds) and, with a `store`, save them for those weights. Returns (record, path)."""
    from fvgraph.request import Request  # request.py imports the interceptor modules

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
        if plan.step_index is not None and any(name.startswith("kept_") for name in outputs):
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
