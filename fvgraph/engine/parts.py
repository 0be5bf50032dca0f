"""One rank's engine parts, built apart from running them: (card, opt level, switches) -> what an Engine runs.

    parts = build_rank_parts(card, checkpoint, opt_level=2, device="cuda", switches=EngineSwitches())

This is the one place that reads what an -O level turns on (fvgraph/runtime/opt_levels.py) and applies it:
the loop the card's recipe assumes (fvgraph/loops/registry.py), its step modules, and for compiling levels
the compile config, FP8 weights, the step compiler, the graph runner and the batching executor.
`Engine.from_card` is a thin front to it; nothing here runs a request.

fvgraph/engine/builder.py builds a whole engine from these (rank 0's, and its workers' when parallel).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fvgraph.adapters.registry import AdapterRegistry
from fvgraph.adapters.setup import AdapterSetup, apply_adapters
from fvgraph.runtime.buckets import BucketSpec
from fvgraph.card import ModelCard
from fvgraph.compile.compiler import CompileConfig, StepCompiler
from fvgraph.models.components import load_components
from fvgraph.contract.counters import Counters
from fvgraph.runtime.checkpoint_recipe import warn_recipe_differences
from fvgraph.runtime.block_streaming import BlockStreaming
from fvgraph.runtime.component_residency import ComponentResidency
from fvgraph.runtime.offload import OffloadPolicy, ResidencyLedger
from fvgraph.runtime.executor import CompiledExecutor, EagerExecutor
from fvgraph.kernels.fp8_weights import apply_fp8_weights
from fvgraph.runtime.graph_runner import GraphRunner
from fvgraph.caching.calibration_store import CalibrationStore, calibration_root
from fvgraph.caching.methods import METHODS, enabled_methods
from fvgraph.contract.loop import Loop
from fvgraph.loops.loop_parts import LoopConfig
from fvgraph.loops.registry import build_loop
from fvgraph.parallel.config import ParallelConfig
from fvgraph.parallel.plan import RankSetup, setup_rank
from fvgraph.runtime.opt_levels import OptLevel, opt_level
from fvgraph.runtime.projection_cache import ExactProjectionCache

log = logging.getLogger(__name__)

# A CFG request of Wan 1.3B holds about 190 MB of text projections; this keeps several requests warm.
DEFAULT_PROJECTION_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineSwitches:
    """Everything besides the card, checkpoint, level and device that changes what gets built."""

    compile_config: CompileConfig | None = None  # backend, passes, step kinds; None: the defaults
    enforce_eager: bool = False  # run eagerly whatever the level (as vLLM's flag)
    cuda_graphs: bool = True  # at -O2 and up; False keeps everything else of the level
    capture_cache_dir: str | Path | None = None  # the capture cache's root (docs/capture_cache.md)
    projection_cache_bytes: int = DEFAULT_PROJECTION_CACHE_BYTES  # eager projection reuse; 0 turns it off
    buckets: BucketSpec = field(default_factory=BucketSpec)
    max_running: int = 16  # requests in flight at once; the rest wait, FIFO
    debug: bool = False  # check static buffer addresses at every replay
    taps: bool = False  # the parity variant: denoise steps also return named intermediates
    text_encoder: bool = True  # False: neither text encoder nor tokenizer loads; requests carry embeddings
    calibration_dir: str | Path | None = None  # calibrated cache settings (default: beside the capture cache)
    step_caching_methods: tuple[str, ...] | None = tuple(METHODS)  # step-caching methods requests may pick (docs/serving.md)
    parallel: ParallelConfig | None = None  # worker processes splitting the denoise steps (docs/parallel.md)
    adapters: AdapterSetup | None = None  # LoRA adapters merged or in slots (docs/adapters.md)
    vae_tiling: bool | dict | None = None  # tiled VAE decode / encode, one step per tile (docs/memory.md)
    offload: OffloadPolicy | str | None = None  # "components" or "blocks:N" (docs/memory.md); checked here

    def __post_init__(self) -> None:
        object.__setattr__(self, "offload", OffloadPolicy.parse(self.offload))
        object.__setattr__(self, "step_caching_methods", enabled_methods(self.step_caching_methods))  # checked, METHODS' order; None: all


@dataclass
class EngineParts:
    card: ModelCard
    loop: Loop
    executor: EagerExecutor | CompiledExecutor
    level: OptLevel  # the level in effect (-O0 under enforce_eager)
    counters: Counters
    projection_cache: ExactProjectionCache | None
    parallel: RankSetup | None = None  # this rank's share of a parallel engine
    adapters: AdapterRegistry | None = None  # the engine's LoRA adapters
    residency: ComponentResidency | BlockStreaming | None = None  # offload (None: every component stays on the device)


def build_rank_parts(card: ModelCard, checkpoint: str | Path | None, level: int, device: str | torch.device | None,
                     switches: EngineSwitches, rank: int = 0, init_method: str | None = None) -> EngineParts:  # fmt: skip
    """One rank's parts. With `switches.parallel`, this process joins the group at `init_method` as
    `rank` and splits its step modules."""
    requested = opt_level(level)
    effective = opt_level(0) if switches.enforce_eager else requested
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    skip = frozenset() if switches.text_encoder else frozenset({"text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"})
    check_offload(switches)  # before loading: what offload holds in host memory is never placed on the device
    held = None if switches.offload is None else switches.offload.host_parts
    components = load_components(card, checkpoint, device, skip, held)
    if checkpoint is not None and rank == 0:  # the folder's own recipe, where it differs from the run's
        warn_recipe_differences(card, checkpoint)
    adapters = None
    if switches.adapters is not None:  # before the loop and its steps: slots are buffers of the steps (on every rank)
        adapters = apply_adapters(components, card.pipeline_class, switches.adapters)
    plan = "single" if switches.parallel is None else f"cfg{switches.parallel.cfg}xulysses{switches.parallel.ulysses}"
    loop = build_loop(card, components, LoopConfig(
        calibration=CalibrationStore(calibration_root(switches.calibration_dir, switches.capture_cache_dir)),
        step_caching_methods=switches.step_caching_methods, adapters=adapters,
        run_facts={"opt_level": effective.level, "parallel": plan},  # what a rollout's record says produced it
        vae_tiling=switches.vae_tiling,
    ))  # fmt: skip
    counters = Counters()
    steps = loop.build_steps(taps=switches.taps)
    parallel = None
    if switches.parallel is not None:
        parallel = setup_rank(switches.parallel, steps, loop.step_kinds, components, rank, init_method, device)
    config = compile_config_for(switches.compile_config or CompileConfig(), effective, switches.taps) if effective.compiled else None
    weights_version = components.weights_version
    if config is not None and config.passes.runs("quantize"):  # before offload, which moves the FP8 buffers with their weights
        weights_version += _apply_fp8(components.transformer, card)
    residency = _offload(switches, card, components, steps, loop, effective, device)
    executor = EagerExecutor(steps, counters, residency=residency)
    if config is not None:
        compiler = StepCompiler(
            config, card.card_id, weights_version, loop.loop_id, card.recipe.precision, device, counters,
            capture_cache_dir=switches.capture_cache_dir, opt_level=effective.level, step_kinds=loop.step_kinds,
            parallel="single" if parallel is None else parallel.plan,
            adapters="none" if adapters is None or adapters.store is None else adapters.store.factor(),
        )  # fmt: skip
        graphs = effective.cuda_graphs and switches.cuda_graphs and device.type == "cuda"
        runner = GraphRunner(compiler, counters, cuda_graphs=graphs, debug=switches.debug)
        executor = CompiledExecutor(executor, compiler, runner, switches.buckets)
    elif switches.capture_cache_dir is not None:
        log.warning("cache_dir=%s is unused: nothing is compiled at opt_level 0 or with enforce_eager", switches.capture_cache_dir)
    projection_cache = None  # per process: on a parallel engine the ranks would have to agree on each hit
    layout = loop.projection_layout  # None: the family declares no projection layout
    streamed = isinstance(residency, BlockStreaming)  # its K/V weights are rewritten every step: no hit could hold
    if effective.eager and switches.projection_cache_bytes and not switches.taps and parallel is None and layout is not None \
            and not streamed:  # fmt: skip
        projection_cache = ExactProjectionCache(max_bytes=switches.projection_cache_bytes)
        layout(components.transformer, projection_cache)
    return EngineParts(card, loop, executor, effective, counters, projection_cache, parallel, adapters, residency)


def _offload(switches: EngineSwitches, card: ModelCard, components, steps: dict, loop: Loop, level: OptLevel,
             device: torch.device) -> ComponentResidency | BlockStreaming | None:  # fmt: skip
    """Offload applied to the built steps' components: whole components (fvgraph/runtime/component_residency.py)
    or the transformers' blocks in groups (fvgraph/runtime/block_streaming.py). What either keeps in host
    memory was loaded there (`OffloadPolicy.host_parts`) and reaches the device only through it."""
    policy = switches.offload
    if policy is None:
        return None
    if policy.mode == "blocks":
        return BlockStreaming(components.modules(), device, policy.blocks, ResidencyLedger(), card.card_id)
    graphed = level.compiled and level.cuda_graphs and switches.cuda_graphs and device.type == "cuda"
    # The kinds compiled by default: on a graphed engine their components' device storage stays put.
    captured = frozenset(kind for kind, declared in loop.step_kinds.items() if declared.compiled) if graphed else frozenset()
    return ComponentResidency(components.modules(), steps, device, ResidencyLedger(), captured)


def check_offload(switches: EngineSwitches) -> None:
    """The offload combinations not built yet, refused before anything is loaded (or any worker started)."""
    policy = switches.offload
    if policy is None:
        return
    if switches.parallel is not None:
        raise ValueError("offload does not run on a parallel engine yet: build it without `parallel`")
    if policy.mode == "blocks" and switches.adapters is not None:
        raise ValueError(f"offload={str(policy)!r} with LoRA adapters is not built yet: build it without `loras`, "
                         'or with offload="components"')  # fmt: skip


def compile_config_for(config: CompileConfig, level: OptLevel, taps: bool) -> CompileConfig:
    """The compile config a level implies: its opt-in passes (-O3: quantize) are enabled; parity tap
    variants get their own pass pipeline (hence their own signatures)."""
    passes = config.passes
    added = tuple(name for name in level.enable_passes if name not in passes.enabled)
    if added:
        passes = dataclasses.replace(passes, enabled=(*passes.enabled, *added))
    if taps:
        passes = dataclasses.replace(passes, taps=True)
    return dataclasses.replace(config, passes=passes)


def _apply_fp8(transformer: torch.nn.Module, card: ModelCard) -> str:
    """FP8 copies of the eligible linears' weights, beside the originals (the eager path keeps using
    those). Returns a weights-version suffix naming the quantized layers: which layers carry FP8
    weights changes the compiled graph's arguments, so it must change the signature too."""
    quantized = apply_fp8_weights(transformer, card.quantization.fp8_exclude)
    if not quantized:
        log.warning("opt_level 3: no linear of %s is eligible for FP8 (K, N multiples of 16, not excluded)", card.card_id)
    return "+fp8:" + hashlib.sha256("|".join(quantized).encode()).hexdigest()[:12]
