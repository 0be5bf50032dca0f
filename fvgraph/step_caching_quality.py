"""Quality as a parity rung: how far a cached run lands from the uncached one (reported, not asserted).

    report = fvgraph.step_caching_quality.cache_distance(engine, requests, "magcache:threshold=0.06")
    report.write_jsonl("quality.jsonl")

Each request runs twice on the same engine, once with the step caching under test and once with
`cache="none"` (same weights, seed, opt level), and is compared:

- per denoise step, the relative L2 distance of the new latents, ||cached - uncached|| / ||uncached||;
- the decoded frames' PSNR, 10 log10(255^2 / MSE) over the uint8 frames (null when they are equal);
- what the caching did (Result.cache): denoiser calls computed and reused, and FLOPs against uncached.

Step caching trades accuracy for speed by design, so nothing here passes or fails: the numbers are
the trade-off, beside the speed perf/bench_interceptors.py measures. `fvgraph parity --cache SPEC
--against none` prints and writes this report (docs/parity.md).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from fvgraph.caching.settings import CacheSettings

from fvgraph.caching.methods import parse_cache_settings
from fvgraph.request import Request


@dataclass
class RequestDistance:
    request: int
    rel_l2: list[float]  # per denoise step
    final_rel_l2: float
    psnr: float | None  # decoded frames, dB; None when they are equal (or not decoded)
    computed: int
    reused: int
    flops_ratio: float  # FLOPs of the cached run / the uncached run's


@dataclass
class QualityReport:
    config: dict
    requests: list[RequestDistance] = field(default_factory=list)

    def summary(self) -> dict:
        psnrs = [r.psnr for r in self.requests if r.psnr is not None]
        return {"type": "summary", "requests": len(self.requests),
                "mean_final_rel_l2": float(np.mean([r.final_rel_l2 for r in self.requests])) if self.requests else 0.0,
                "min_psnr": min(psnrs) if psnrs else None,
                "flops_ratio": float(np.mean([r.flops_ratio for r in self.requests])) if self.requests else 1.0}  # fmt: skip

    def write_jsonl(self, path: str | Path) -> Path:
        path = Path(path)
        lines = [{"type": "config", **self.config}, *({"type": "request", **asdict(r)} for r in self.requests), self.summary()]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return path


def rel_l2(value: torch.Tensor, reference: torch.Tensor) -> float:
    norm = reference.float().norm().item()
    return (value.float() - reference.float()).norm().item() / norm if norm else float((value != reference).any())


def psnr(frames: np.ndarray, reference: np.ndarray) -> float | None:
    """PSNR in dB of uint8 frames against the reference's; None when equal."""
    mse = float(np.mean((frames.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return None if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _run(engine, requests: Sequence[Request]) -> tuple[list, dict[tuple[int, int], torch.Tensor]]:
    """Results and every denoise step's new latents, by (request index, step)."""
    index = {r.request_id: i for i, r in enumerate(requests)}
    latents: dict[tuple[int, int], torch.Tensor] = {}
    kinds = engine.loop.step_kinds

    def keep(state, plan, outputs):
        if kinds[plan.kind].per_inference_step:
            latents[(index[state.request_id], plan.step_index)] = outputs["latents"].float().cpu()

    results = engine.generate(list(requests), on_result=keep)
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"quality run of request {failed[0].request_id} {failed[0].status}: {failed[0].error}")
    return results, latents


def cache_distance(engine, requests: Sequence[Request], cache: str | dict | CacheSettings) -> QualityReport:
    """`requests` with `cache` against the same requests with caching off, on `engine`."""
    settings = parse_cache_settings(cache)
    if settings is None or settings.method == "none":
        raise ValueError("cache: name the caching under test (METHOD[:k=v,...]); it is compared with caching off")
    cached = [r.model_copy(update={"cache": settings, "request_id": f"{r.request_id}-cached"}) for r in requests]
    plain = [r.model_copy(update={"cache": parse_cache_settings("none"), "request_id": f"{r.request_id}-none"}) for r in requests]
    cached_results, cached_latents = _run(engine, cached)
    plain_results, plain_latents = _run(engine, plain)
    report = QualityReport({"card": engine.card.card_id, "opt_level": engine.opt_level, "cache": settings.model_dump(mode="json"),
                            "against": "none", "requests": len(requests)})  # fmt: skip
    for i, (ours, theirs) in enumerate(zip(cached_results, plain_results)):
        steps = sorted(step for (r, step) in plain_latents if r == i)
        distances = [rel_l2(cached_latents[(i, s)], plain_latents[(i, s)]) for s in steps]
        frames = None if ours.frames is None or theirs.frames is None else psnr(ours.frames, theirs.frames)
        counts = ours.cache or {}
        ratio = counts["flops"] / counts["flops_uncached"] if counts.get("flops_uncached") else 1.0
        report.requests.append(RequestDistance(i, distances, rel_l2(ours.latents, theirs.latents), frames,
                                               counts.get("computed", 0), counts.get("reused", 0), ratio))  # fmt: skip
    return report
