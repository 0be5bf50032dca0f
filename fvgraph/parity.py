"""Parity diff: the same requests at two settings, compared tap by tap, step by step.

    report = fvgraph.parity.compare("tiny-wan", requests, Setting(opt_level=0), Setting(opt_level=1))
    report.passed, report.first_divergence, report.write_jsonl("parity.jsonl")

Both sides run the tap variant of the card's denoise step (fvgraph/loops/taps.py): every block output per
CFG branch, both branch predictions, the guided prediction, and the sampler's new latents, per step.
A denoise step kind without a tap variant (step caching's keep and reuse kinds) is compared by its
new latents only.
Each pair of tensors gets max_abs, max_rel, rel_diff (||a - b|| / ||b||), the smallest atol (at
rtol 0) and rtol (at atol 0) that would pass, the argmax coordinate with both values, and NaN/Inf
counts; it passes when |a - b| <= atol + rtol * |b| with the card's component tolerance for its
precision. The noise floor is side A against itself with the other batch composition (together
instead of one at a time, or the reverse; an eager side runs together as one padded batch, as the
compiled executor does); each comparison reports its max_abs next to the floor's. When side B *is*
side A at the other composition, that run is B itself, so the report says there is no floor.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.runtime.executor import EagerExecutor
from fvgraph.passes.manager import PassConfig
from fvgraph.request import Request
from fvgraph.loops.taps import split_fused

Taps = dict[tuple[int, int, str], torch.Tensor]  # (request index, step, tap name) -> tensor


@dataclass(frozen=True)
class Setting:
    """One side of a comparison."""

    opt_level: int = 0
    backend: str = "inductor"
    disabled_passes: tuple[str, ...] = ()
    batched: bool = False  # run the requests together (one batch per step at -O1+) instead of one by one

    def label(self) -> str:
        extra = f" {self.backend}" if self.opt_level else ""
        batched = " batched" if self.batched else ""
        return f"O{self.opt_level}{extra}{batched}" + "".join(f" -{p}" for p in self.disabled_passes)


@dataclass
class Comparison:
    request: int
    step: int
    tap: str
    max_abs: float
    max_rel: float
    rel_diff: float
    atol_to_pass: float
    rtol_to_pass: float
    argmax: list[int]
    a: float
    b: float
    nan: int
    inf: int
    floor_max_abs: float | None  # None: the report has no floor (config's noise_floor says why)
    passed: bool


@dataclass
class ParityReport:
    config: dict
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.comparisons)

    @property
    def first_divergence(self) -> Comparison | None:
        return next((c for c in self.comparisons if not c.passed), None)

    def summary(self) -> dict:
        first = self.first_divergence
        return {
            "type": "summary", "passed": self.passed, "comparisons": len(self.comparisons),
            "failed": sum(not c.passed for c in self.comparisons),
            "first_divergence": None if first is None else {"request": first.request, "step": first.step, "tap": first.tap},
            "worst_max_abs": max((c.max_abs for c in self.comparisons), default=0.0),
        }  # fmt: skip

    def write_jsonl(self, path: str | Path) -> Path:
        path = Path(path)
        lines = [{"type": "config", **self.config}]
        lines += [{"type": "comparison", **asdict(c)} for c in self.comparisons]
        lines.append(self.summary())
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return path


def run_taps(engine: Engine, requests: Sequence[Request], batched: bool, batch_sizes: set[int] | None = None) -> Taps:
    """Every tapped step's taps (and new latents) of each request, run alone or all together (an
    eager engine then runs each step's group as one padded batch). `batch_sizes` collects the size of
    every tapped step's group that ran."""
    index = {r.request_id: i for i, r in enumerate(requests)}
    taps: Taps = {}

    def keep(state, plan, result):
        tapped = {k: v for k, v in result.items() if k.startswith("tap.")}
        if not tapped and not engine.loop.step_kinds[plan.kind].per_inference_step:  # encoders, decoders
            return
        # A denoise kind without a tap variant (a cached step: keep or reuse) is compared by its latents.
        named = split_fused(tapped)
        named["tap.latents"] = result["latents"]
        for name in sorted(named, key=execution_order):
            value = named[name]
            taps[(index[state.request_id], plan.step_index, name)] = value.float().cpu()

    groups = [list(requests)] if batched else [[r] for r in requests]
    executor = engine.executor
    run_batch = executor.run_batch

    def recorded(plans, slots, lane=0):
        results = run_batch(plans, slots, lane)
        if batch_sizes is not None and any(k.startswith("tap.") for k in results[0]):  # a tapped step's group
            batch_sizes.add(len(plans))
        return results

    eager = isinstance(executor, EagerExecutor)
    executor.run_batch = recorded  # instance attribute: removed again below
    if eager and batched:
        executor.padded = engine.buckets
    try:
        for group in groups:
            for result in engine.generate([r.model_copy() for r in group], on_result=keep):
                if not result.ok:
                    raise RuntimeError(f"parity run of request {result.request_id} {result.status}: {result.error}")
    finally:
        del executor.run_batch
        if eager:
            executor.padded = None
    return taps


def execution_order(name: str) -> tuple:
    """Where a tap is computed in the step: cond blocks, cond prediction, uncond blocks, uncond
    prediction, guided prediction, new latents. The first divergence is the first in this order."""
    if name.startswith("tap.block."):
        block, branch = name.removeprefix("tap.block.").split(".")
        return (int(branch) * 2, int(block))
    return {"tap.noise.cond": (1, 0), "tap.noise.uncond": (3, 0), "tap.noise": (4, 0), "tap.latents": (5, 0)}[name]


def diff(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> dict:
    """Metrics of `b` against the reference `a`; passes when |b - a| <= atol + rtol * |a|, all finite."""
    delta = (b - a).abs()
    finite = torch.isfinite(delta)
    safe = torch.where(finite, delta, torch.zeros_like(delta))
    flat = int(safe.argmax())
    rel = torch.where((a.abs() > 0) & finite, safe / a.abs().clamp_min(1e-30), torch.zeros_like(delta))
    norm_a = a.norm().item()
    return {
        "max_abs": safe.max().item(), "max_rel": rel.max().item(),
        "rel_diff": (b - a).norm().item() / norm_a if norm_a else float(safe.max().item() > 0),
        "atol_to_pass": safe.max().item(), "rtol_to_pass": rel.max().item(),
        "argmax": [int(i) for i in torch.unravel_index(torch.tensor(flat), delta.shape)] if delta.numel() else [],
        "a": a.flatten()[flat].item(), "b": b.flatten()[flat].item(),
        "nan": int(torch.isnan(a).sum() + torch.isnan(b).sum()), "inf": int(torch.isinf(a).sum() + torch.isinf(b).sum()),
        "passed": bool(finite.all()) and bool(torch.allclose(b, a, atol=atol, rtol=rtol)),
    }  # fmt: skip


def _engine(card, setting: Setting, checkpoint, device, adapters: dict | None) -> Engine:
    config = CompileConfig(backend=setting.backend, passes=PassConfig(disabled=setting.disabled_passes))
    return Engine.from_card(card, checkpoint=checkpoint, opt_level=setting.opt_level, device=device,
                            compile_config=config, taps=True, **(adapters or {}))  # fmt: skip


def compare(card, requests: Sequence[Request], a: Setting, b: Setting, checkpoint=None, device=None,
            prepare_b: Callable[[Engine], None] | None = None, adapters: dict | None = None) -> ParityReport:  # fmt: skip
    """Run `requests` at settings `a` (the reference) and `b`; `prepare_b` may alter engine B (tests
    use it to inject an error). `adapters`: Engine.from_card's loras / merge_loras / lora_slots, on both."""
    engine_a, engine_b = _engine(card, a, checkpoint, device, adapters), _engine(card, b, checkpoint, device, adapters)
    if prepare_b is not None:
        prepare_b(engine_b)
    # An FP8 side (opt level 3) is held to the card's fp8 tolerance, not the model's own precision's.
    precision = "fp8" if max(a.opt_level, b.opt_level) >= 3 else engine_a.card.recipe.precision
    tol = engine_a.card.parity.tolerance(precision, "component")
    sizes = {"a": set(), "b": set(), "floor": set()}
    reference = run_taps(engine_a, requests, a.batched, sizes["a"])
    other = run_taps(engine_b, requests, b.batched, sizes["b"])
    floor_setting = dataclasses.replace(a, batched=not a.batched)
    if floor_setting == b:  # the floor run would be side b's run again: it would only restate b
        floor, floor_note = None, "none: side b is side a at the other batch composition, which is what a floor measures"
    else:
        floor = run_taps(engine_a, requests, floor_setting.batched, sizes["floor"])
        floor_note = f"side a against itself with the other batch composition ({floor_setting.label()})"
    report = ParityReport({
        "card": engine_a.card.card_id, "a": a.label(), "b": b.label(), "requests": len(requests),
        "precision": precision, "atol": tol.atol, "rtol": tol.rtol, "noise_floor": floor_note,
        "denoise_batch_sizes": {side: sorted(s) for side, s in sizes.items() if floor is not None or side != "floor"},
    })  # fmt: skip
    for key, ref in reference.items():  # dict order: request, then step, then tap in execution order
        if key not in other:
            raise KeyError(f"side b produced no tap {key[2]!r} at request {key[0]} step {key[1]}")
        row = diff(ref, other[key], tol.atol, tol.rtol)
        floor_abs = None if floor is None else (floor[key] - ref).abs().max().item() if key in floor else float("nan")
        report.comparisons.append(Comparison(request=key[0], step=key[1], tap=key[2], floor_max_abs=floor_abs, **row))
    return report
