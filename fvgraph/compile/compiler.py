"""StepCompiler: WorkPlan -> StepSignature -> captured graph -> passes -> backend -> CompiledStep.

One artifact per signature, built the first time a plan with that signature runs (or at warmup).
Compiled steps are called directly with their flat arguments, keyed by signature, with no dynamo
guards on the serving path: the signature *is* the guard, and a frozen compiler refuses to build a
new one (the engine's `fail_on_recompile` stance), naming the factors that differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.nn.attention import sdpa_kernel

from fvgraph.compile.compiled_block_copies import aot_eager_in_place, inductor_config
from fvgraph.compile.capture_cache import CacheEntry, CaptureCache
from fvgraph.contract.counters import Counters
from fvgraph.contract.flops import graph_flops
from fvgraph.contract.progress import progress_span
from fvgraph.compile.graph_artifact import SUFFIX, artifact_kind, load_graph, load_in_child, save_graph, save_graph_in_child
from fvgraph.kernels.attention import sdpa_backends
from fvgraph.contract.plan import WorkPlan
from fvgraph.contract.step_kind import StepKind
from fvgraph.compile.signature import RuntimeFactors, StepSignature
from fvgraph.compile.step_capture import capture_step
from fvgraph.passes.base import step_parameters
from fvgraph.passes.base import PassContext
from fvgraph.passes.manager import PassConfig, PassManager

log = logging.getLogger(__name__)

Backend = Literal["eager", "aot_eager", "inductor"]

# Inductor settings, each with its reason, in one place.
INDUCTOR_CONFIG = {
    # fvgraph captures CUDA graphs itself (static buffers, one pool, bucketed); inductor's own
    # cudagraph trees would capture a second time underneath.
    "triton.cudagraphs": False,
}


class PackageDoesNotLoad(RuntimeError):
    """The artifacts just built for a step did not load in a child process: the capture cache marks
    the step (CaptureCache.mark_unloadable), and this process identity compiles it in process."""


class RecompileError(RuntimeError):
    """A new signature showed up after warmup, while serving under fail_on_recompile."""


class AttentionChoice(CustomGraphPass):
    """Carries a step's SDPA backend choice into inductor's cache keys; changes no graph.

    The choice is applied with `sdpa_kernel(...)` while AOTAutograd traces, which picks the attention
    op; but AOTAutograd's and inductor's caches key on the dynamo graph and inductor's config, where the
    choice does not appear, so after a change of the backend table a cached graph could come back with
    the old kernel. A custom pass's uuid is part of both keys."""

    def __init__(self, backends: str):
        self.backends = backends

    def __call__(self, graph: torch.fx.Graph) -> None:
        pass

    def uuid(self) -> str:
        return f"fvgraph-sdpa:{self.backends}"



@runtime_checkable
class AttentionShaped(Protocol):
    """A step module that says what its denoiser's self-attention runs at, for the SDPA backend choice."""

    def attention_shape(self, inputs: dict[str, torch.Tensor]) -> tuple[int, int, torch.dtype]: ...

@dataclass(frozen=True)
class CompileConfig:
    backend: Backend = "inductor"
    mode: str = "default"
    passes: PassConfig = field(default_factory=PassConfig)
    # Which step kinds compile. None: the ones the loop marks `compiled` (its per-step kinds, where
    # compiling pays; encoders and decoders run once per request). "all": every kind. Or the names.
    step_kinds: tuple[str, ...] | Literal["all"] | None = None
    # How the capture cache stores inductor graphs (graph_artifact.ARTIFACT_FORMATS): inductor's
    # standalone artifact, an AOTInductor package ("aoti"), or "auto": standalone on a GPU, aoti on a CPU.
    artifact_format: Literal["auto", "standalone", "aoti"] = "auto"

    def __post_init__(self) -> None:
        artifact_kind(self.backend, self.artifact_format)  # ValueError naming artifact_format


@dataclass
class CompiledStep:
    signature: StepSignature
    step_fn: object
    prologue_fn: object | None
    params: list[torch.Tensor]
    input_names: list[str]
    output_names: list[str]
    passes_changed: dict[str, int]
    compile_seconds: float
    # The prologue's outputs as meta tensors: their shapes and strides are what the step was compiled
    # for (inductor asserts input strides), so static buffers copy them.
    hoisted_like: list[torch.Tensor] = field(default_factory=list)
    # Functional collectives (op name -> count) in the graphs handed to the backend: a parallel
    # step's communication is part of its graph, not a call around it.
    collectives: dict[str, int] = field(default_factory=dict)
    # FLOPs of one call of the step graph after the passes (hoisted work excluded: the prologue's is
    # apart); None when not counted (loaded from the capture cache, or an op with no fake kernel).
    flops: int | None = None
    # Inputs the step graph no longer reads after the passes (a text only its hoisted values came
    # from): only the prologue does, so a runner need not keep them current in the step's buffers.
    unread_inputs: frozenset[str] = frozenset()


class StepCompiler:
    """Builds (or, with a capture cache, loads) one CompiledStep per signature.

    Without a capture cache, graphs are compiled in process (inductor's `compile_fx`). With `capture_cache_dir`, each
    graph is compiled to a file (graph_artifact), published to the CaptureCache under this process's
    fingerprint, and run from that file; a later process with the same fingerprint loads it instead
    of compiling (`counters.capture_cache_hits`)."""

    def __init__(self, config: CompileConfig, card_id: str, weights_version: str, loop_id: str, precision: str,
                 device: torch.device, counters: Counters, capture_cache_dir: str | Path | None = None,
                 opt_level: int = 1, step_kinds: dict[str, StepKind] | None = None,
                 parallel: str = "single", adapters: str = "none"):  # fmt: skip
        self.config = config
        self.step_kinds = step_kinds or {}  # the loop's declarations: component, compiled by default
        self.pass_manager = PassManager(config.passes)
        self.counters = counters
        self.device = device
        self.frozen = False
        self._base = dict(card_id=card_id, weights_version=weights_version, loop=loop_id, precision=precision,
                          parallel=parallel, adapters=adapters)  # fmt: skip
        self._runtime = RuntimeFactors.current(device)
        self._compiled: dict[StepSignature, CompiledStep] = {}
        self._rejected: dict[str, tuple[dict, str]] = {}  # cache entries found unusable: key -> (record, why)
        self._loaded_in_child: set[str] = set()  # cache entries a child process has loaded (GPU AOTInductor)
        self.capture_cache = None if capture_cache_dir is None else CaptureCache(capture_cache_dir, self.fingerprint(opt_level))

    def fingerprint(self, opt_level: int) -> dict:
        """The process identity a capture cache directory belongs to (every signature shares it)."""
        return dict(
            card_id=self._base["card_id"], weights_version=self._base["weights_version"], opt_level=opt_level,
            pass_pipeline=self.pass_manager.uuid(), backend=self.config.backend, mode=self.config.mode,
            artifact_kind=self._artifact_kind, **dataclasses.asdict(self._runtime),
        )  # fmt: skip

    def wants(self, kind: str) -> bool:
        chosen = self.config.step_kinds
        if chosen is None:
            declared = self.step_kinds.get(kind)
            return declared is not None and declared.compiled
        return chosen == "all" or kind in chosen

    def signature(self, plan: WorkPlan, batch: int = 1, step: nn.Module | None = None) -> StepSignature:
        return self._signature(plan, batch, self._sdpa_backends(step, plan))

    def _signature(self, plan: WorkPlan, batch: int, backends: list | None) -> StepSignature:
        return StepSignature(
            component=self._component(plan.kind), step_kind=plan.kind, shape=plan.signature,
            batch=batch, pass_pipeline=self.pass_manager.uuid(), backend=self.config.backend,
            mode=self.config.mode, runtime=self._runtime, **self._base,
            attention=",".join(b.name for b in backends) if backends else "default",
        )  # fmt: skip

    def _component(self, kind: str) -> str:
        declared = self.step_kinds.get(kind)
        return declared.component if declared is not None else kind

    def _sdpa_backends(self, step: nn.Module | None, plan: WorkPlan) -> list | None:
        """The SDPA backends chosen for this step's attention shape on this device (measured table in
        fvgraph.kernels.attention), or None for steps that declare no attention shape."""
        if not isinstance(step, AttentionShaped) or self.device.type != "cuda":
            return None  # on a CPU the choice changes nothing: keep torch's own order
        return sdpa_backends(*step.attention_shape(plan.inputs), self.device)

    def get(self, step: nn.Module, plan: WorkPlan, batch: int = 1) -> CompiledStep:
        """The compiled step for `plan`'s signature at `batch` (plan inputs already have that batch)."""
        backends = self._sdpa_backends(step, plan)
        signature = self._signature(plan, batch, backends)
        compiled = self._compiled.get(signature)
        if compiled is None:
            # Attention kernels are picked while inductor traces (and again if aot_eager re-traces a
            # loaded graph), so the chosen SDPA backends hold around both.
            with contextlib.nullcontext() if backends is None else sdpa_kernel(backends, set_priority=True):
                label = f"{plan.kind}, batch bucket {batch}"  # announced: the waits a person sees (contract/progress.py)
                if self.capture_cache is not None:
                    with progress_span("loading", label):
                        compiled = self._load_cached(step, plan, signature)
                if compiled is None:
                    if self.frozen:  # loading a warm artifact is fine; compiling a new one is not
                        raise RecompileError(self._refusal(signature))
                    with progress_span("compiling", label):
                        compiled = self._build(step, plan, signature)
            self._compiled[signature] = compiled
        return compiled

    @property
    def signatures(self) -> list[StepSignature]:
        return list(self._compiled)

    @property
    def compiled_steps(self) -> list[CompiledStep]:
        return list(self._compiled.values())

    def _build(self, step: nn.Module, plan: WorkPlan, signature: StepSignature) -> CompiledStep:
        began = time.perf_counter()
        with self.pass_manager.tracing(step):  # what a pass needs of the step while it is traced (CFG fusion)
            captured = capture_step(plan.kind, step, plan.inputs)
        ctx = PassContext(root=step, example_args=captured.example_args, num_params=captured.num_params,
                          batch=signature.batch)
        gm = self.pass_manager(captured.gm, ctx)
        base_args, hoisted = list(captured.example_args), []
        if ctx.prologue is not None:
            with torch.no_grad():
                hoisted = list(ctx.prologue(*base_args))
        meta = dict(
            param_names=captured.param_names, input_names=captured.input_names,
            output_names=captured.output_names + ctx.extra_outputs, passes_changed=dict(ctx.changed),
            hoisted_like=[dict(shape=list(t.shape), stride=list(t.stride()), dtype=str(t.dtype)) for t in hoisted],
            collectives=collective_counts(gm, ctx.prologue), flops=graph_flops(gm, base_args + hoisted),
            unread_inputs=_unread_inputs(gm, captured.num_params, captured.input_names),
        )  # fmt: skip
        compiled = None
        known = self.capture_cache.unloadable(signature.key(), signature.factors()) if self.capture_cache is not None else None
        if known is not None:  # built here before, and it did not load: not built again
            log.warning("capture cache: compiling %s in process: its packages, built here before, did not load (%s); "
                        "`fvgraph cache clear` forgets this", plan.kind, known)  # fmt: skip
        elif self.capture_cache is not None:
            try:
                compiled = self._compile_through_cache(signature, gm, ctx.prologue, base_args, hoisted, meta, began)
            except PackageDoesNotLoad as err:
                self.capture_cache.mark_unloadable(signature.key(), signature.factors(), str(err))
                log.warning("capture cache: could not store %s, compiling it in process instead (and in later "
                            "processes, without building it again): %s", plan.kind, err)  # fmt: skip
            except Exception as err:  # a graph AOTInductor cannot package is still served, compiled in process
                log.warning("capture cache: could not store %s, compiling it in process instead: %r", plan.kind, err)
        if compiled is None:
            attention = signature.attention
            prologue_fn = None if ctx.prologue is None else self._backend_compile(ctx.prologue, base_args, attention)
            compiled = self._backend_compile(gm, base_args + hoisted, attention), prologue_fn, meta
        step_fn, prologue_fn, meta = compiled
        seconds = time.perf_counter() - began
        self.counters.compiles += 1
        self.counters.compile_seconds += seconds
        log.info("compiled %s in %.1f s (passes changed %s)\n%s", plan.kind, seconds, ctx.changed, signature)
        return self._compiled_step(signature, step, step_fn, prologue_fn, meta, seconds)

    def _compiled_step(self, signature: StepSignature, step: nn.Module, step_fn, prologue_fn, meta: dict,
                       seconds: float) -> CompiledStep:  # fmt: skip
        return CompiledStep(
            signature, step_fn, prologue_fn, list(step_parameters(step).values()), meta["input_names"],
            meta["output_names"], meta["passes_changed"], seconds, [_like(h, "meta") for h in meta["hoisted_like"]],
            meta.get("collectives", {}), meta.get("flops"), frozenset(meta.get("unread_inputs", ())),
        )  # fmt: skip

    # -- through the capture cache -----------------------------------------------------------------

    def _compile_through_cache(self, signature, gm, prologue, base_args, hoisted, meta, began):
        """Compile each graph to a file, publish the files, and run what was published (another
        process's entry, when it published this signature first). Returns (step_fn, prologue_fn, meta)."""
        kind = self._artifact_kind
        in_child, suffix = self._aoti_in_child, SUFFIX.get(kind, ".pt2")  # see graph_artifact: AOTInductor never crashes this process
        with self.capture_cache.staging_dir() as staging:
            files = {"step": Path(staging) / f"step{suffix}"}
            graphs = [(gm, base_args + hoisted, files["step"])]
            if prologue is not None:
                files["prologue"] = Path(staging) / f"prologue{suffix}"
                graphs.append((prologue, base_args, files["prologue"]))
            for graph, args, path in graphs:
                patches = self._inductor_patches(signature.attention, graph)
                if in_child:
                    save_graph_in_child(graph, args, path, patches)
                else:
                    save_graph(graph, args, kind, path, patches)
            meta["compile_seconds"] = time.perf_counter() - began
            if in_child:
                problem = load_in_child(files.values(), kind, self.device)
                if problem is not None:
                    raise PackageDoesNotLoad(f"the built package does not load: {problem}")
            rejected = self._rejected.get(signature.key(), (None, ""))[0]  # replaced even if its hash checks out
            entry = self.capture_cache.publish(signature.key(), signature.factors(), files, meta, replace=rejected)
        self.counters.capture_cache_stores += 1
        return (*self._load_entry(entry, base_args), entry.meta)

    def _load_cached(self, step: nn.Module, plan: WorkPlan, signature: StepSignature) -> CompiledStep | None:
        entry = self.capture_cache.find(signature.key())
        if entry is None:
            return None
        began = time.perf_counter()
        base_args = [*step_parameters(step).values(), *plan.inputs.values()]
        problem = self.capture_cache.check(entry, signature.factors())
        if problem is None and entry.meta.get("param_names") != list(step_parameters(step)):
            problem = "the step's parameters differ from the ones it was compiled with"
        if problem is None and entry.meta.get("input_names") != list(plan.inputs):
            problem = f"its input names {entry.meta.get('input_names')} are not the step's {list(plan.inputs)}"
        if problem is None and self._aoti_in_child and entry.key not in self._loaded_in_child:
            paths = [self.capture_cache.path(entry, name) for name in entry.artifact_names]
            problem = load_in_child(paths, self.config.backend, self.device)  # the first load of a hit, in a child
            self._loaded_in_child.add(entry.key)
        if problem is None:
            try:
                step_fn, prologue_fn = self._load_entry(entry, base_args)
            except Exception as err:  # an artifact that will not load is as bad as a corrupted one
                problem = str(err)
        if problem is not None:
            log.warning("capture cache: entry %s of %s rejected, rebuilding: %s", entry.key,
                        self.capture_cache.dir / "manifest.json", problem)  # fmt: skip
            self._rejected[entry.key] = (entry.record, problem)
            self.counters.capture_cache_rejects += 1
            return None
        self.counters.capture_cache_hits += 1
        log.info("loaded %s from the capture cache in %.2f s\n%s", plan.kind, time.perf_counter() - began, signature)
        return self._compiled_step(signature, step, step_fn, prologue_fn, entry.meta, 0.0)

    def _load_entry(self, entry: CacheEntry, base_args: list[torch.Tensor]):
        prologue_fn = None
        if "prologue" in entry.artifact_names:
            prologue_fn = self._load_artifact(entry, "prologue", base_args)
        hoisted = [_like(h, self.device) for h in entry.meta["hoisted_like"]]
        return self._load_artifact(entry, "step", base_args + hoisted), prologue_fn

    def _load_artifact(self, entry: CacheEntry, name: str, example_args: list[torch.Tensor]):
        """load_graph of one artifact; RuntimeError naming its file when it does not load."""
        path = self.capture_cache.path(entry, name)
        try:
            return load_graph(path, self._artifact_kind, self.device, self._backend_compile, example_args)
        except Exception as err:
            raise RuntimeError(f"{name} artifact {path} failed to load: {err!r}") from err

    @property
    def _artifact_kind(self) -> str:
        return artifact_kind(self.config.backend, self.config.artifact_format, self.device.type)

    @property
    def _aoti_in_child(self) -> bool:
        """AOTInductor packages on a GPU: built, and first loaded, in a child process."""
        return self._artifact_kind == "inductor" and self.device.type == "cuda"

    def _backend_compile(self, gm: torch.fx.GraphModule, example_args: list[torch.Tensor], attention: str = "default"):
        backend = self.config.backend
        if backend == "eager":
            return gm
        if backend == "aot_eager":  # dynamo's aot_eager, with block offload's copies written in place
            return aot_eager_in_place(gm, example_args)
        from torch._inductor.compile_fx import compile_fx

        with torch.no_grad():
            return compile_fx(gm, example_args, config_patches=self._inductor_patches(attention, gm))

    def _inductor_patches(self, attention: str = "default", gm: torch.fx.GraphModule | None = None) -> dict:
        """Inductor config for one compile. The mode's options come first and fvgraph's settings after,
        so a mode cannot turn back on what fvgraph turns off ("max-autotune" and "reduce-overhead"
        both set triton.cudagraphs). `attention` is the signature's SDPA choice (see AttentionChoice);
        `gm`, the graph compiled: one with block offload's copies adds what those need (compiled_block_copies)."""
        patches = {} if self.config.mode == "default" else dict(torch._inductor.list_mode_options(self.config.mode))
        patches.update(INDUCTOR_CONFIG)
        if gm is not None:
            patches.update(inductor_config(gm))
        if attention != "default":
            patches["post_grad_custom_pre_pass"] = AttentionChoice(attention)
        return patches

    def _refusal(self, signature: StepSignature) -> str:
        same_kind = [s for s in self._compiled if s.step_kind == signature.step_kind] or list(self._compiled)
        rejected = self._rejected.get(signature.key())
        if rejected is not None:  # not a new signature: its warm entry is there but unusable
            return (f"the capture cache entry for this signature was rejected ({rejected[1]}), and after warmup "
                    f"(fail_on_recompile) it is not rebuilt here: run `fvgraph warmup` again to rebuild it\n{signature}")
        lines = [f"no compiled graph for a new signature after warmup (fail_on_recompile):\n{signature}"]
        if same_kind:
            nearest = min(same_kind, key=lambda s: len(signature.diff(s)))
            lines.append("differs from the nearest warm signature in: " + "; ".join(signature.diff(nearest)))
        if self.capture_cache is not None:
            lines.append(f"the capture cache {self.capture_cache.dir} has no usable entry for it either: "
                         "run `fvgraph warmup` for this shape and batch bucket")  # fmt: skip
        return "\n".join(lines)


def collective_counts(*graphs: torch.fx.GraphModule | None) -> dict[str, int]:
    """How many of each functional collective (`_c10d_functional.*`) the graphs call."""
    counts: dict[str, int] = {}
    for gm in graphs:
        for node in [] if gm is None else gm.graph.nodes:
            name = str(node.target)
            if node.op == "call_function" and name.startswith("_c10d_functional."):
                counts[name] = counts.get(name, 0) + 1
    return counts


def _unread_inputs(gm: torch.fx.GraphModule, num_params: int, input_names: list[str]) -> list[str]:
    """The step inputs (placeholders after the `num_params` parameters) that no node of `gm` uses."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    inputs = placeholders[num_params : num_params + len(input_names)]
    return [name for name, node in zip(input_names, inputs) if not node.users]


def _like(spec: dict, device: torch.device | str) -> torch.Tensor:
    """A zero tensor with a recorded shape, stride and dtype (hoisted values' layout)."""
    dtype = getattr(torch, spec["dtype"].removeprefix("torch."))
    return torch.empty_strided(spec["shape"], spec["stride"], dtype=dtype, device=device).zero_()
