"""Engine: loads a card once and drives many requests' loops, interleaved step by step.

    engine = Engine.from_card("tiny-wan")
    results = engine.generate([Request(prompt="a red fox", seed=0), Request(prompt="snow", seed=1)])

Each tick the scheduler admits requests, collects every running loop's next WorkPlan and groups the
compatible ones; the executor runs each group (eagerly one by one at -O0, as one padded compiled
batch at -O1/-O2) and the results are folded back into each loop. A request that is rejected (bad
input for this card), fails (an error in one of its steps) or is cancelled gets a Result saying so;
the other requests carry on. `generate` runs a list of requests to the end; `submit` + `tick` is the
same machinery for serving, where requests arrive while others are mid-run. The engine holds no
per-request state beyond its queue: that is all in each request's loop state, which `start` / `step`
/ `finish` / `resume` expose for saving and resuming.

The engine is composed, as vLLM's v1 engine holds its scheduler and executor: beside the scheduler
and the executor it holds the run-ahead order of a tick's batches (fvgraph/engine/run_ahead.py), the
adapter admin (adapter_admin.py), weight sync (weight_sync.py), sleep and wake (sleep.py) and rollouts
(rollouts.py), each handed exactly the parts and engine calls it uses; its methods for those delegate to them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import ValidationError

from fvgraph.runtime.buckets import BucketSpec
from fvgraph.card import ModelCard
from fvgraph.card_for_checkpoint import card_for_checkpoint
from fvgraph.card_choices import chosen_card
from fvgraph.cards import get_card
from fvgraph.compile.compiler import CompileConfig, StepCompiler
from fvgraph.contract.counters import Counters
from fvgraph.adapters.lora_file import LoraWeights
from fvgraph.adapters.registry import AdapterRegistry
from fvgraph.adapters.setup import LoraFile, engine_adapter_setup
from fvgraph.adapters.slots import LoraSlots
from fvgraph.behavior import BehaviorRecord
from fvgraph.engine.adapter_admin import AdapterAdmin
from fvgraph.engine.builder import build_engine_parts
from fvgraph.engine.fold_back import FramesCallback, PreviewCallback, ResultCallback, StepCallback, with_previews
from fvgraph.engine.rollouts import Rollouts
from fvgraph.engine.run_ahead import RunAhead
from fvgraph.engine.sleep import EngineSleep
from fvgraph.engine.weight_sync import WeightSync
from fvgraph.engine.parts import DEFAULT_PROJECTION_CACHE_BYTES, EngineSwitches
from fvgraph.runtime.executor import CompiledExecutor, EagerExecutor
from fvgraph.runtime.tf32_switch import math_mode
from fvgraph.contract.loop import Loop, LoopState
from fvgraph.contract.plan import Done, WorkPlan
from fvgraph.parallel.config import ParallelConfig
from fvgraph.parallel.executor import ParallelExecutor
from fvgraph.parallel.rank_adapters import RankAdapters
from fvgraph.parallel.workers import WorkersLost
from fvgraph.contract.model_facts import ModelFacts
from fvgraph.models.hub_checkpoint import local_checkpoint
from fvgraph.runtime.block_streaming import BlockStreaming
from fvgraph.runtime.component_residency import ComponentResidency
from fvgraph.runtime.projection_cache import ExactProjectionCache
from fvgraph.runtime.residency_order import ResidentFirst
from fvgraph.request import Request, RequestRejected, Result
from fvgraph.runtime.request_slot import RequestSlots
from fvgraph.runtime.scheduler import Scheduler

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, card: ModelCard, loop: Loop, executor: EagerExecutor | CompiledExecutor, opt_level: int,
                 counters: Counters, buckets: BucketSpec, max_running: int, run_ahead: bool = False,
                 projection_cache: ExactProjectionCache | None = None, adapters: AdapterRegistry | None = None,
                 residency: ComponentResidency | BlockStreaming | None = None):  # fmt: skip
        self.card = card
        self.buckets = buckets
        self.max_running = max_running
        # Component offload orders a tick by what is resident; block offload streams within each step.
        order = ResidentFirst(residency) if isinstance(residency, ComponentResidency) else None
        self._scheduler = Scheduler(loop, buckets, max_running, order)
        self.residency = None if residency is None else residency.ledger  # offload's ResidencyLedger (docs/memory.md)
        self._in_flight: dict[str, float] = {}  # submitted, not yet handed back: id -> submit time
        self._outbox: list[Result] = []  # ended, not yet handed back
        self.loop = loop
        self.executor = executor
        self.opt_level = opt_level
        self.counters = counters
        self.projection_cache = projection_cache  # an eager engine's (None: compiled, or turned off)
        self.adapters = adapters  # the LoRA adapters (None: none loaded, no slots)
        self._math = math_mode(card.recipe.precision)  # held around every call that runs steps (fvgraph/runtime/tf32_switch.py)
        self._slots = RequestSlots()  # what the runtime keeps per request (hoisted values, row owner)
        self._running_steps = False  # a tick or step is under way: its callbacks may not drive the engine
        # Each collaborator is handed the parts and engine calls it uses, nothing else. The bound methods
        # they hold make a reference cycle: a dropped engine is freed by the cyclic collector.
        self._ahead = RunAhead(loop, self._scheduler, self._slots, executor, counters, self._fail, run_ahead)
        ranks = RankAdapters(executor.group) if isinstance(executor, ParallelExecutor) and adapters is not None else None
        self._adapter_admin = AdapterAdmin(adapters, projection_cache, self._live_states, self._refuse_reentry, self.drain, ranks)
        between_ticks = (self._live_states, self._refuse_reentry, self.cancel, partial(self._tick, None, None), self.drain)
        self._sleep = EngineSleep(card, loop, executor, projection_cache, self._scheduler, residency, adapters, *between_ticks)
        self._weight_sync = WeightSync(loop, executor, projection_cache, self._scheduler, *between_ticks, self._sleep)
        self._rollouts = Rollouts(self.start, self.step, self.generate)

    @property
    def run_ahead(self) -> bool:
        """Whether the host prepares the next batch before reading the last one back (fvgraph/engine/run_ahead.py)."""
        return self._ahead.enabled

    @run_ahead.setter
    def run_ahead(self, enabled: bool) -> None:
        self._ahead.enabled = enabled

    @property
    def before_commit(self) -> Callable[[], None] | None:
        """Called once per tick before it is committed; running ahead, after its first batch was launched."""
        return self._ahead.before_commit

    @before_commit.setter
    def before_commit(self, call: Callable[[], None] | None) -> None:
        self._ahead.before_commit = call

    @property
    def facts(self) -> ModelFacts:
        """What the loaded weights say: text width, latent channels, patch size, VAE scales, experts."""
        return self.loop.components.facts

    @property
    def compiler(self) -> StepCompiler | None:
        return self.executor.compiler

    @classmethod
    def from_card(
        cls,
        card: str | ModelCard | None,
        checkpoint: str | Path | None = None,
        opt_level: int = 0,
        device: str | torch.device | None = None,
        cache_dir: str | Path | None = None,
        compile_config: CompileConfig | None = None,
        enforce_eager: bool = False,
        projection_cache_bytes: int = DEFAULT_PROJECTION_CACHE_BYTES,
        buckets: BucketSpec | None = None,
        max_running: int = 16,
        cuda_graphs: bool = True,
        debug: bool = False,
        taps: bool = False,
        text_encoder: bool = True,
        calibration_dir: str | Path | None = None,
        cache_methods: Iterable[str] | None = None,
        parallel: ParallelConfig | None = None,
        dtype: str | torch.dtype | None = None,
        recipe: dict | None = None,
        loras: dict[str, str | Path | LoraFile] | None = None,
        merge_loras: dict[str, float] | None = None,
        lora_slots: LoraSlots | None = None,
        run_ahead: bool | None = None,
        vae_tiling: bool | dict | None = None,
        offload: str | None = None,
    ) -> Engine:
        """Validate the card, then load its weights (seeded, or from a diffusers `checkpoint`: a local folder,
        or a Hub repo id resolved through huggingface_hub's cache, fvgraph/models/hub_checkpoint.py;
        `card=None` with a checkpoint: the card its repo id or pipeline class names, fvgraph/card_for_checkpoint.py).

        opt_level 0 runs eagerly (request-constant projections through an ExactProjectionCache of
        `projection_cache_bytes`, 0 off); 1 compiles each step kind (CompileConfig: backend, passes,
        kinds) and batches compatible steps of different requests (`buckets`); 2 also replays CUDA
        graphs (`cuda_graphs=False` alone turns that off); 3 adds FP8 weights and kernels for the
        denoiser's eligible linears (`quantization.fp8_exclude` aside). `enforce_eager` overrides the
        level, as in vLLM. `max_running` caps the requests in flight (FIFO); `debug` checks static
        buffer addresses at every replay. `cache_dir`: the on-disk capture cache (docs/capture_cache.md),
        after which `warmup` freezes the engine. `taps`: the parity variant ("tap.*" outputs).
        `text_encoder=False`: no text encoder or tokenizer; requests carry embeddings. `calibration_dir`:
        calibrated step-caching settings. `cache_methods`: the step-caching methods requests may pick (None: all; empty: exact
        only; docs/serving.md). `parallel`: worker processes that split each denoise step (docs/parallel.md).
        `dtype` ("fp32", "bf16", "fp16", a torch dtype) and `recipe` (fvgraph/card_choices.py) choose over the
        card. `loras` (name -> local file; LoraFile(path, expert="transformer_2") for a two-expert card's
        low-noise expert): adapters requests choose with `Request.loras`, fused when named in
        `merge_loras` (a LoRA distill's recipe adapter is: docs/recipes.md); `lora_slots` sizes the slots.
        `run_ahead` (None: on CUDA only): the host prepares the next batch while the device runs the last
        one, with the same results as the serial order (fvgraph/engine/run_ahead.py). `vae_tiling`: True tiles
        the VAE's decode and encode with diffusers' defaults for its class, a dict with the keywords of its
        `enable_tiling(...)`; each tile is a step of its own (docs/memory.md). `offload="components"`: each
        component on the device only while its steps run; `offload="blocks:N"`: the transformers' blocks
        streamed from host memory N at a time; both counted in `engine.residency` (docs/memory.md).
        """
        folder = None if checkpoint is None else local_checkpoint(checkpoint)
        if card is None and folder is None:
            raise ValueError("card=None names no card: give a card name, or a checkpoint whose repo id or folder picks one")
        card = card_for_checkpoint(checkpoint, folder, "a card") if card is None else get_card(card) if isinstance(card, str) else card
        card = chosen_card(card, dtype, recipe)
        switches = EngineSwitches(
            compile_config=compile_config, enforce_eager=enforce_eager, cuda_graphs=cuda_graphs, capture_cache_dir=cache_dir,
            projection_cache_bytes=projection_cache_bytes, buckets=buckets or BucketSpec(), max_running=max_running,
            debug=debug, taps=taps, text_encoder=text_encoder, calibration_dir=calibration_dir,
            step_caching_methods=cache_methods, parallel=parallel,
            adapters=engine_adapter_setup(card, loras, merge_loras, lora_slots), vae_tiling=vae_tiling, offload=offload,
        )  # fmt: skip
        parts = build_engine_parts(card, folder, opt_level, device, switches)  # with its worker ranks when parallel
        ahead = parts.loop.components.device.type == "cuda" if run_ahead is None else run_ahead
        return cls(card, parts.loop, parts.executor, parts.level.level, parts.counters, switches.buckets, max_running,
                   ahead, parts.projection_cache, parts.adapters, parts.residency)  # fmt: skip

    @property
    def unavailable(self) -> str | None:
        """Why this engine takes no more work (a parallel engine that lost a worker rank), or None."""
        return self.executor.unavailable

    def close(self) -> None:
        """Release what the engine holds beyond memory: a parallel engine's worker processes."""
        self.drain()
        self.executor.close()

    # -- adapters, weights, rollouts: each its collaborator's ----------------------------------------

    def loras(self) -> list[dict[str, Any]]:
        """The loaded adapters: name, path, digest, rank, adapted modules, slot (None: merged)."""
        return self._adapter_admin.loras()

    def read_lora(self, name: str, path: str | Path, expert: str | None = None) -> LoraWeights:
        """Read and check a LoRA file for `name`, changing nothing (any thread; fvgraph/engine/adapter_admin.py)."""
        return self._adapter_admin.read_lora(name, path, expert)

    def load_lora(self, name: str, source: str | Path | LoraWeights, expert: str | None = None) -> dict[str, Any]:
        """A local LoRA file (or what read_lora read) into a free slot, between ticks; `expert`: a two-expert
        card's 'transformer' (default, high noise) or 'transformer_2' (fvgraph/engine/adapter_admin.py)."""
        return self._adapter_admin.load_lora(name, source, expert)

    def unload_lora(self, name: str) -> dict[str, Any]:
        """Free `name`'s slot; refused while a request in flight chose it (fvgraph/engine/adapter_admin.py)."""
        return self._adapter_admin.unload_lora(name)

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: str,
                       in_flight: Literal["finish", "stop"] = "finish") -> dict:  # fmt: skip
        """New denoiser weights, called `version`, with nothing recompiled (fvgraph/engine/weight_sync.py)."""
        return self._weight_sync.update_weights(weights, version, in_flight)

    def sleep(self, level: int = 1, in_flight: Literal["finish", "stop", "refuse"] = "finish") -> dict:
        """The denoiser's weights off the device: 1 to host memory, 2 discarded (fvgraph/engine/sleep.py)."""
        return self._sleep.sleep(level, in_flight)

    def wake(self) -> dict:
        """The denoiser's weights back, bit for bit, nothing recompiled (fvgraph/engine/sleep.py)."""
        return self._sleep.wake()

    @property
    def asleep(self) -> int | None:
        """The sleep level (1 or 2), or None when awake."""
        return self._sleep.level

    def rollout(self, prompts: Sequence[str], group_size: int, seed: int, noise_level: float = 0.7,
                on_step: StepCallback | None = None, **fields) -> list[BehaviorRecord]:  # fmt: skip
        """One BehaviorRecord per sample, `group_size` per prompt (fvgraph/engine/rollouts.py)."""
        return self._rollouts.rollout(prompts, group_size, seed, noise_level, on_step, **fields)

    # -- one request at a time -------------------------------------------------------------------

    def start(self, request: Request) -> LoopState:
        """Check `request` against the card and build its loop state. Raises RequestRejected (EngineAsleep)."""
        self._sleep.refuse_while_asleep()
        return self.loop.init(self.loop.check_request(request))

    def resume(self, state: LoopState) -> LoopState:
        """Adopt a state saved by another engine (same card); it continues where it stopped. The
        loop's `state_type.load(path)` reads what `state.save(path)` wrote."""
        return self.loop.adopt(state)

    def step(self, state: LoopState, on_step: StepCallback | None = None) -> bool:
        """Run the request's next step. Returns False once the loop is done."""
        self.drain()
        self._sleep.refuse_while_asleep()
        plan = self.loop.next(state)
        if isinstance(plan, Done):
            return False
        with torch.compiler.set_stance(self._stance()), self._math, self._not_reentrant("step"):
            failures = self._ahead.run_group([(state, plan)], on_step)
        if failures:
            raise failures[0][1]
        return True

    def warmup(self, requests: Sequence[Request], on_bucket: Callable[[int], None] | None = None) -> list[Result]:
        """Prepare every batch bucket of each request's compiled step (largest first; compiled, or
        loaded from the capture cache), serve the requests, then refuse any new compile:
        fail_on_recompile. Every other compiled step kind the requests run while served (step
        caching's keep and reuse kinds, a second expert's) is prepared at every bucket too, the
        first time it runs. `on_bucket(batch)` is called as each bucket is ready (progress bars)."""
        prepare = partial(self._prepare, set(), on_bucket)  # with the signatures prepared so far
        with self._ahead.warming(prepare):
            if isinstance(self.executor, CompiledExecutor):
                for request in requests:
                    try:
                        state = self.start(request)
                    except RequestRejected:
                        continue  # generate() below hands it back as rejected, naming the rule
                    while not isinstance(plan := self.loop.next(state), Done):
                        if self.compiler.wants(plan.kind):
                            prepare(plan)
                            break
                        self.step(state)
            results = self.generate(requests)
        self.freeze()
        return results

    def _prepare(self, prepared: set, on_bucket: Callable[[int], None] | None, plan: WorkPlan) -> None:
        """During warmup: compile (or load) `plan`'s signature at every batch bucket, once."""
        if plan.signature in prepared or not isinstance(self.executor, CompiledExecutor):
            return
        prepared.add(plan.signature)
        with self._math:
            self.executor.prepare(plan, on_bucket)
        for variant in self.loop.warmup_variants(plan):  # kinds chosen by data the warmup run need not produce
            self._prepare(prepared, on_bucket, variant)

    def freeze(self) -> None:
        """Refuse any new compile from now on (fail_on_recompile): a step whose signature is neither
        compiled in this process nor in the capture cache fails with RecompileError naming it."""
        if self.compiler is not None:
            self.compiler.frozen = True

    def _stance(self) -> str:
        """torch's compile stance while serving. Compiled steps are called directly, not through
        dynamo, and a frozen compiler refuses new signatures itself (RecompileError); the stance
        makes any dynamo compile that slipped past it fail as well."""
        return "fail_on_recompile" if self.compiler is not None and self.compiler.frozen else "default"

    def finish(self, state: LoopState) -> Result:
        while self.step(state):
            pass
        return self.loop.finalize(state)

    def cancel(self, request_id: str) -> bool:
        """Cancel a request in flight (submitted, not yet handed back) at its next step boundary; it
        comes back with status 'cancelled'. Returns False, and changes nothing, for an id not in flight
        or one that has already ended (its result waiting to be handed back): a stale cancel must
        not reach a later request that reuses the id."""
        if request_id not in self._in_flight or any(r.request_id == request_id for r in self._outbox):
            return False
        self._scheduler.cancel(request_id)
        return True

    # -- many requests, interleaved ----------------------------------------------------------------

    def submit(self, request: Request) -> str:
        """Queue `request` for the next tick (FIFO behind the others) and return its id. Raises
        RequestRejected, naming the field and the rule, when the card cannot serve it or its id is
        still in flight; nothing is queued then and the engine serves on."""
        if not isinstance(request, Request):
            raise TypeError(f"requests must be fvgraph.Request objects, got {type(request).__name__}")
        if request.request_id in self._in_flight:
            raise RequestRejected("request_id", f"{request.request_id!r} is already in flight")
        if self.unavailable is not None:
            raise WorkersLost(f"the engine takes no new requests: {self.unavailable}")
        self._scheduler.submit(self.start(request))
        self._in_flight[request.request_id] = time.perf_counter()
        return request.request_id

    def drain(self) -> None:
        """Settle the batch a tick left running ahead (its requests' failures and on_step); a no-op
        serially. What reads or changes the engine's requests or weights outside a tick calls it."""
        if self._ahead.launched is not None:
            with torch.compiler.set_stance(self._stance()), self._not_reentrant("drain"):
                self._ahead.settle_launched()

    def has_work(self) -> bool:
        """Whether some submitted request has not come back from tick() yet."""
        return bool(self._in_flight)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet handed back: running, waiting, or ended in the outbox."""
        return len(self._in_flight)

    def tick(self, on_step: StepCallback | None = None, on_result: ResultCallback | None = None,
             on_preview: PreviewCallback | None = None, on_frames: FramesCallback | None = None) -> list[Result]:  # fmt: skip
        """One scheduler round: admit waiting requests, run every group of compatible steps once and
        fold the results back. Returns the requests that ended in it (done, failed or cancelled).
        With `submit` this is the serving loop: requests join while others are mid-run.
        `on_preview` and `on_frames` as in generate."""
        on_step = with_previews(self.loop, on_step, on_preview, on_frames)
        with torch.compiler.set_stance(self._stance()):
            self._tick(on_step, on_result)
        return self._take_results()

    def generate(self, requests: Sequence[Request], on_step: StepCallback | None = None,
                 on_result: ResultCallback | None = None, on_preview: PreviewCallback | None = None,
                 on_frames: FramesCallback | None = None) -> list[Result]:  # fmt: skip
        """Run every request to completion, interleaved step by step; results in request order.

        Each tick the scheduler groups the compatible steps of the running requests; a compiled
        engine runs each group as one padded batch, an eager one runs its members one by one. A
        request the card cannot serve comes back 'rejected'. Requests submitted earlier keep running
        alongside; their results wait for the next tick(). `on_preview(PreviewEvent)` is called for each
        preview a request with `preview_every` makes (docs/previews.md), after that step's on_step;
        `on_frames(DecodedFrames)` for each run of frames a decode step makes final, in order
        (docs/serving.md, streamed video)."""
        on_step = with_previews(self.loop, on_step, on_preview, on_frames)
        for request in requests:  # misuse, not bad input: refused before anything is queued
            if not isinstance(request, Request):
                raise TypeError(f"requests must be fvgraph.Request objects, got {type(request).__name__}")
        rejected: dict[int, Result] = {}  # by position: a duplicate id must not shadow the original's result
        pending: set[str] = set()
        for position, request in enumerate(requests):
            try:
                if request.request_id in pending:
                    raise RequestRejected("request_id", f"{request.request_id!r} appears twice in one generate() call")
                pending.add(self.submit(request))
            except (RequestRejected, ValidationError) as err:
                log.warning("request %s rejected: %s", request.request_id, err)
                rejected[position] = Result(request.request_id, "rejected", seed=request.seed, error=str(err))
        results: dict[str, Result] = {}
        try:
            # Entered once per call, not per tick or batch: the stance costs ~50 us, the math switches tens
            # (each tick enters the math mode again, which inside this costs a counter).
            with torch.compiler.set_stance(self._stance()), self._math:
                while pending:
                    if not self._scheduler.has_work() and self._ahead.launched is None:
                        raise RuntimeError(f"requests {sorted(pending)} neither ran nor ended")  # a bug, never a hang
                    self._tick(on_step, on_result, "generate")
                    for result in self._take_results(pending):
                        results[result.request_id] = result
                        pending.discard(result.request_id)
        except BaseException:  # a callback raised (or ^C): this call's requests must not stay in flight
            self._abandon(pending)
            raise
        return [rejected.get(i) or results[r.request_id] for i, r in enumerate(requests)]

    @contextmanager
    def _not_reentrant(self, what: str):
        """A callback runs between one request's step and the next member's: a tick, generate or step
        started there would run and advance the same requests again (and hand results to the wrong
        caller). Callbacks may submit and cancel; they must return before the engine runs on."""
        self._refuse_reentry(what)
        self._running_steps = True
        try:
            yield
        finally:
            self._running_steps = False

    def _refuse_reentry(self, what: str, instead: str = "the engine is not re-entrant; submit or cancel from the "
                        "callback and drive the engine after it returns") -> None:  # fmt: skip
        if self._running_steps:
            raise RuntimeError(f"Engine.{what}() was called from inside a callback (on_step / on_result) of a running tick: "
                               f"{instead}")  # fmt: skip

    def _tick(self, on_step: StepCallback | None, on_result: ResultCallback | None, what: str = "tick") -> None:
        # _not_reentrant written out: this runs every tick, where a generator-based context manager
        # costs more than the check.
        self._refuse_reentry(what)
        self._running_steps = True
        try:
            with self._math:
                self._tick_once(on_step, on_result)
        finally:
            self._running_steps = False

    def _tick_once(self, on_step: StepCallback | None, on_result: ResultCallback | None) -> None:
        order = self._ahead  # the order this tick's batches run and are read back in
        ahead = order.tick_runs_ahead(on_result)
        if ahead:
            tick = order.planned_ahead()
        else:
            order.settle_launched()
            if order.before_commit is not None:
                order.before_commit()
            tick = self._scheduler.tick()
        for state, err in tick.failed:
            log.error("request %s failed planning its next step: %r", state.request_id, err)
            self._slots.release(state)
            self._done(Result(state.request_id, "failed", seed=state.seed, timings=dict(state.timings),
                              error=f"planning its next step: {err!r}"))  # fmt: skip
        for state in tick.cancelled:
            self._slots.release(state)
            self._done(Result(state.request_id, "cancelled", seed=state.seed, timings=dict(state.timings)))
        for state in tick.finished:
            self._slots.release(state)
            try:
                result = self.loop.finalize(state)
            except Exception as err:  # its result could not be built; the others carry on
                log.exception("request %s failed in finalize", state.request_id)
                result = Result(state.request_id, "failed", seed=state.seed, timings=dict(state.timings), error=repr(err))
            self._done(result)
        groups = tick.groups
        while groups:  # a step of a kind that `continues` has its request's next step run in this tick too
            continuing = []
            for group in groups:
                if ahead and order.runs_ahead(group):
                    order.launch_ahead(group, on_step)  # settles the group launched before it
                    continue
                order.settle_launched()
                failed = order.run_group(group.members, on_step, on_result, group.lane)
                self._fail(failed)
                if self.loop.step_kinds[group.members[0][1].kind].continues:
                    gone = {id(state) for state, _ in failed}
                    continuing += [state for state, _ in group.members if id(state) not in gone]
            groups = self._scheduler.continue_within_tick(continuing) if continuing else []

    def _fail(self, failed: list[tuple[LoopState, Exception]]) -> None:
        """Requests whose step failed leave the batch (their rows go to the last ones) with a failed result."""
        for state, err in failed:
            self._scheduler.remove([state])
            self._slots.release(state)
            self._done(Result(state.request_id, "failed", seed=state.seed, timings=dict(state.timings), error=repr(err)))

    def _abandon(self, ids: set[str]) -> None:
        """Drop these requests wherever they are (waiting, running, ended): nobody will take their results."""
        self._ahead.drop()  # their requests' results are this call's, dropped with it
        self._scheduler.abandon(ids)
        self._outbox = [r for r in self._outbox if r.request_id not in ids]
        for request_id in ids:
            self._in_flight.pop(request_id, None)

    def _live_states(self) -> list[LoopState]:
        """The states of the requests submitted and not ended: waiting, then running."""
        return [*self._scheduler.waiting, *self._scheduler.running]

    def _done(self, result: Result) -> None:
        result.timings["total"] = time.perf_counter() - self._in_flight[result.request_id]
        self._scheduler.ended(result.request_id)
        self._outbox.append(result)

    def _take_results(self, ids: set[str] | None = None) -> list[Result]:
        """Hand back the ended results (those of `ids` only, when given); a handed-back id is free again."""
        taken = [r for r in self._outbox if ids is None or r.request_id in ids]
        self._outbox = [r for r in self._outbox if ids is not None and r.request_id not in ids]
        for result in taken:
            del self._in_flight[result.request_id]
        return taken
