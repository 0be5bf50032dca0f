"""Calibrated step-caching settings on disk: measured once per model by `fvgraph calibrate`, found again by weights.

Some methods' settings are calibrated per model (MagCache's `mag_ratios`). `fvgraph.engine.calibrate`
measures them on an engine; `CalibrationStore` keeps the result as JSON at

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
from pathlib import Path
from typing import Any

DEFAULT_CALIBRATION_DIR = Path("capture_cache") / "calibration"


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
