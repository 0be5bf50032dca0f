"""Engine: loads a card once and drives many requests' loops, interleaved step by step.

    engine = Engine.from_card("tiny-wan")
    results = engine.generate([Request(prompt="a red fox", seed=0), Request(prompt="snow", seed=1)])

Each tick asks every running request's loop for its next WorkPlan and executes it. A request that is
rejected (bad input for this card) or fails (an error in one of its steps) gets a Result saying so;
the other requests carry on. The engine itself holds no per-request state: that is all in each
request's loop state, which `start` / `step` / `finish` expose for saving and resuming.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from pydantic import ValidationError

from fvgraph.card import ModelCard
from fvgraph.cards import get_card
from fvgraph.components import load_components
from fvgraph.compiler import CompileConfig, StepCompiler
from fvgraph.counters import Counters
from fvgraph.executor import CompiledExecutor, EagerExecutor, build_steps
from fvgraph.loop import Done
from fvgraph.projection_cache import ExactProjectionCache
from fvgraph.projection_cache_wan import apply_projection_cache
from fvgraph.request import Request, RequestRejected, Result
from fvgraph.t2v_loop import DENOISE, DENOISE_CFG, T2VState, TextToVideoLoop

log = logging.getLogger(__name__)

StepCallback = Callable[[T2VState, str], None]
# A CFG request of Wan 1.3B holds about 190 MB of text projections; this keeps several requests warm.
DEFAULT_PROJECTION_CACHE_BYTES = 1 << 30
OPT_LEVELS = {0: "eager", 1: "compiled step graphs"}


class Engine:
    def __init__(self, card: ModelCard, loop: TextToVideoLoop, executor: EagerExecutor | CompiledExecutor,
                 opt_level: int, counters: Counters):  # fmt: skip
        self.card = card
        self.loop = loop
        self.executor = executor
        self.opt_level = opt_level
        self.counters = counters
        self.projection_cache: ExactProjectionCache | None = None  # set by from_card when eager

    @property
    def compiler(self) -> StepCompiler | None:
        return getattr(self.executor, "compiler", None)

    @classmethod
    def from_card(
        cls,
        card: str | ModelCard,
        checkpoint: str | Path | None = None,
        opt_level: int = 0,
        device: str | torch.device | None = None,
        cache_dir: str | Path | None = None,
        compile_config: CompileConfig | None = None,
        enforce_eager: bool = False,
        projection_cache_bytes: int = DEFAULT_PROJECTION_CACHE_BYTES,
    ) -> Engine:
        """Validate the card, then load its weights (seeded, or from a local diffusers `checkpoint`).

        opt_level 0 runs eagerly; 1 compiles each step kind into a graph (CompileConfig picks the
        backend, passes and step kinds). `enforce_eager` overrides the level, as in vLLM. When running
        eagerly, request-constant projections go through an ExactProjectionCache of
        `projection_cache_bytes` (0 turns it off); compiled steps hoist them instead.
        """
        card = get_card(card) if isinstance(card, str) else card
        if opt_level not in OPT_LEVELS:
            available = ", ".join(f"{level} ({what})" for level, what in OPT_LEVELS.items())
            raise ValueError(f"opt_level={opt_level} is not available; this build supports {available}")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        components = load_components(card, checkpoint, device)
        loop = TextToVideoLoop(card, components)
        counters = Counters()
        executor = EagerExecutor(build_steps(loop), counters)
        if opt_level >= 1 and not enforce_eager:
            compiler = StepCompiler(
                compile_config or CompileConfig(), card.card_id, components.weights_version, loop.loop_id,
                card.recipe.precision, device, counters,
            )  # fmt: skip
            executor = CompiledExecutor(executor, compiler)
        engine = cls(card, loop, executor, 0 if enforce_eager else opt_level, counters)
        if engine.compiler is None and projection_cache_bytes:
            engine.projection_cache = ExactProjectionCache(max_bytes=projection_cache_bytes)
            apply_projection_cache(components.transformer, engine.projection_cache)
        return engine

    # -- one request at a time -------------------------------------------------------------------

    def start(self, request: Request) -> T2VState:
        """Check `request` against the card and build its loop state. Raises RequestRejected."""
        return self.loop.init(request.resolve(self.card))

    def resume(self, state: T2VState) -> T2VState:
        """Adopt a state saved by another engine (same card); it continues where it stopped."""
        self.loop.check_state(state)
        device = self.loop.components.device
        for name in ("latents", "prompt_embeds", "negative_prompt_embeds"):
            value = getattr(state, name)
            if value is not None:
                setattr(state, name, value.to(device))
        state.carry = [t.to(device) for t in state.carry]
        return state

    def step(self, state: T2VState, on_step: StepCallback | None = None) -> bool:
        """Run the request's next step. Returns False once the loop is done."""
        plan = self.loop.next(state)
        if isinstance(plan, Done):
            return False
        began, compile_seconds = time.perf_counter(), self.counters.compile_seconds
        result = self.executor.run(plan)
        phase = "denoise" if plan.kind in (DENOISE, DENOISE_CFG) else plan.kind
        compiled_for_it = self.counters.compile_seconds - compile_seconds  # reported apart from the step time
        if compiled_for_it:
            state.timings["compile"] = state.timings.get("compile", 0.0) + compiled_for_it
        elapsed = time.perf_counter() - began - compiled_for_it
        state.timings[phase] = state.timings.get(phase, 0.0) + elapsed
        self.loop.advance(state, result)
        if on_step is not None:
            on_step(state, plan.kind)
        return True

    def warmup(self, requests: Sequence[Request]) -> list[Result]:
        """Serve `requests` (compiling what they need), then refuse any new compile: fail_on_recompile."""
        results = self.generate(requests)
        if self.compiler is not None:
            self.compiler.frozen = True
        return results

    def finish(self, state: T2VState) -> Result:
        while self.step(state):
            pass
        return self.loop.finalize(state)

    # -- many requests, interleaved ----------------------------------------------------------------

    def generate(self, requests: Sequence[Request], on_step: StepCallback | None = None) -> list[Result]:
        """Run every request to completion, one step of each per tick; results in request order."""
        began = time.perf_counter()
        results: dict[str, Result] = {}
        running: list[T2VState] = []
        for request in requests:
            try:
                running.append(self.start(request))
            except (RequestRejected, ValidationError) as err:
                log.warning("request %s rejected: %s", request.request_id, err)
                results[request.request_id] = Result(request.request_id, "rejected", seed=request.seed, error=str(err))
        while running:
            still_running = []
            for state in running:
                try:
                    if self.step(state, on_step):
                        still_running.append(state)
                        continue
                    result = self.loop.finalize(state)
                except Exception as err:  # one request's failure must not take the others down
                    log.exception("request %s failed at %s step %d", state.request_id, state.phase, state.step_index)
                    result = Result(state.request_id, "failed", seed=state.seed, timings=dict(state.timings), error=repr(err))
                result.timings["total"] = time.perf_counter() - began
                results[state.request_id] = result
            running = still_running
        return [results[r.request_id] for r in requests]
