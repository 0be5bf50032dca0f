"""The runtime knows no loop: it reads a loop's declarations, keeps its own per-request slot, and is
built from (card, opt level, switches) in one place."""

import ast
import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import fvgraph
from fvgraph.runtime.buckets import BucketSpec
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.engine.parts import compile_config_for
from fvgraph.loops.registry import LOOPS, loop_class
from fvgraph.runtime.opt_levels import OPT_LEVELS, opt_level
from fvgraph.request import Request
from fvgraph.loops.expert_loop import SECOND_EXPERT_KINDS
from fvgraph.caching.fb_cache_steps import AFTER_FIRST_KINDS, FIRST_BLOCK_KINDS
from fvgraph.loops.i2v_loop import STEP_KINDS as I2V_STEP_KINDS
from fvgraph.loops.t2v_loop import STEP_KINDS, T2VState, TextToVideoLoop

PACKAGE = Path(fvgraph.__file__).parent
RUNTIME = ("engine", "runtime/scheduler", "runtime/executor", "compile/compiler",
           "runtime/graph_runner", "parity", "cli", "runtime/request_slot", "runtime/opt_levels", "loops/registry",
           "serving/async_engine", "serving/jsonl_server", "serving/http_app")  # fmt: skip


@pytest.mark.parametrize("module", RUNTIME)
def test_runtime_modules_name_no_loop_type_or_step_kind(module):
    path = PACKAGE / module
    source = "\n".join(f.read_text() for f in sorted(path.glob("*.py"))) if path.is_dir() else path.with_suffix(".py").read_text()
    loop_names = {"t2v_loop", "i2v_loop", "expert_loop", "ti2v_loop", "T2VState", "I2VState", "TI2VState", "TextToVideoLoop",
                  "ImageToVideoLoop", "TextImageToVideoLoop", "TwoExperts", "DenoiseFacts", *STEP_KINDS, *I2V_STEP_KINDS,
                  *SECOND_EXPERT_KINDS}  # fmt: skip
    if module == "loops/registry":  # the registry names loops by import path, and nothing else
        source = re.sub(r'LOOPS: dict\[str, str\] = \{.*?\n\}', "", source, flags=re.S)
    for name in loop_names:
        assert not re.search(rf"[\"'.]{name}\b|\b{name}[\"']|import .*\b{name}\b", source), f"{module}.py names {name!r}"


# The top-level folders install under the fvgraph namespace (pyproject's package-dir).
ROOTS = {"fvgraph": PACKAGE, "fvgraph.passes": PACKAGE.parent / "passes", "fvgraph.cards": PACKAGE.parent / "cards"}  # fmt: skip


def _modules() -> dict[str, Path]:
    found = {}
    for prefix, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((prefix, *parts))] = path
    return found


def _package(module: str) -> str:
    """A module's package at the level the layers are drawn: fvgraph's subpackages and top-level modules."""
    return ".".join(module.split(".")[:2])


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The fvgraph modules `module` imports at run time (module level or in functions), TYPE_CHECKING blocks aside."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}  # fmt: skip
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            found.update(t for t in (base, *(f"{base}.{a.name}" for a in node.names)) if t in known)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
    return found


def test_the_package_import_graph_has_no_cycle():
    """Layers import downward only: between packages (fvgraph's subpackages and top-level modules, and
    passes/ and cards/ under their fvgraph.* names) the import graph has no cycle."""
    known = _modules()
    graph: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for module, path in known.items():
        for target in _imports(module, path, known):
            a, b = _package(module), _package(target)
            if a != b:
                graph.setdefault(a, set()).add(b)
                why.setdefault((a, b), f"{module} imports {target}")
    state: dict[str, int] = {}

    def visit(package: str, path: list[str]) -> None:
        if state.get(package) == 1:
            cycle = [*path[path.index(package):], package]
            raise AssertionError("package import cycle: " + "; ".join(why[(a, b)] for a, b in zip(cycle, cycle[1:])))
        if state.get(package) == 2:
            return
        state[package] = 1
        for dep in sorted(graph.get(package, ())):
            visit(dep, [*path, package])
        state[package] = 2

    for package in sorted(graph):
        visit(package, [])


def test_the_registry_picks_the_cards_loop_and_names_the_known_ones():
    assert loop_class("t2v") is TextToVideoLoop
    with pytest.raises(ValueError, match="loop 'v2v' is not registered; known loops: .*t2v"):
        loop_class("v2v")
    assert set(LOOPS) == {"t2v", "i2v", "t2v_two_expert", "i2v_two_expert", "ti2v", "flux", "flux_kontext", "qwen_image", "qwen_image_edit",
                          "hunyuan_video15_t2v", "hunyuan_video15_i2v"}


def test_the_loop_declares_its_kinds_and_the_compiler_reads_them(tiny_engine):
    kinds = tiny_engine.loop.step_kinds
    denoise_kinds = ["denoise", "denoise_cfg", "denoise_keep", "denoise_reuse", "denoise_cfg_keep", "denoise_cfg_reuse",
                     "denoise_taylor_keep", "denoise_taylor_predict", "denoise_cfg_taylor_keep", "denoise_cfg_taylor_predict",
                     *FIRST_BLOCK_KINDS.values(), *AFTER_FIRST_KINDS.values(), "denoise_sde", "denoise_sde_cfg"]  # fmt: skip
    assert {k for k, v in kinds.items() if v.compiled} == set(denoise_kinds)  # then step caching's, then rollouts' (SDE)
    assert {v.component for v in kinds.values()} == {"text_encoder", "transformer", "vae"}
    engine = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=CompileConfig(backend="eager"))
    assert [k for k in kinds if engine.compiler.wants(k)] == denoise_kinds
    every = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=CompileConfig(step_kinds="all"))
    assert all(every.compiler.wants(k) for k in kinds)


def test_timings_are_keyed_by_the_loops_phases(tiny_engine):
    """A video-to-video request runs every phase of the loop (its video's encode too), each timed under its name."""
    video = [np.zeros((8, 8, 3), np.uint8)]
    [result] = tiny_engine.generate([Request(prompt="a kite", seed=0, num_inference_steps=2, video=video)])
    phases = {kind.phase for kind in tiny_engine.loop.step_kinds.values()}
    assert phases <= set(result.timings) and set(result.timings) - phases == {"total"}


def test_hoisted_values_live_in_the_runtimes_slot_and_go_with_the_request():
    """The compiled step's prologue outputs are kept in a RequestSlot the engine owns, not in the
    loop's state; a lone request stepped by hand keeps its slot between steps, and every slot is
    released when its request ends."""
    config = CompileConfig(backend="eager", step_kinds=("denoise_cfg",))
    engine = Engine.from_card("tiny-wan", device="cpu", opt_level=1, compile_config=config,
                              buckets=BucketSpec(batch_sizes=(1,)))  # fmt: skip
    state = engine.start(Request(prompt="a boat", seed=1, num_inference_steps=3, num_frames=5))
    for _ in range(3):  # text encode, then two denoise steps: the prologue runs once
        engine.step(state)
    assert engine.counters.prologue_runs == 1
    [hoisted] = engine._slots.of(state).hoisted.values()
    assert hoisted and all(isinstance(t, torch.Tensor) for t in hoisted)
    assert not hasattr(state, "step_cache") and not any(isinstance(v, dict) and v for k, v in vars(state).items() if k != "timings")
    results = engine.generate([Request(prompt=f"p{i}", seed=i, num_inference_steps=2, num_frames=5) for i in range(2)])
    assert all(r.ok for r in results)
    assert len(engine._slots) == 1  # only the hand-stepped state above still holds one
    del state
    assert len(engine._slots) == 0


def test_resume_goes_through_the_loops_state_type(tmp_path, tiny_engine):
    state = tiny_engine.start(Request(prompt="x", seed=0, num_inference_steps=2, num_frames=1))
    tiny_engine.step(state)
    state.save(tmp_path / "s.pt")
    loaded = tiny_engine.loop.state_type.load(tmp_path / "s.pt")
    assert isinstance(loaded, T2VState) and loaded.derived is None
    with pytest.raises(ValueError, match="resumes a T2VState"):
        tiny_engine.resume(object())


def test_one_frozen_table_says_what_each_level_turns_on():
    assert [n for n, spec in OPT_LEVELS.items() if spec.compiled] == [1, 2, 3]
    assert [n for n, spec in OPT_LEVELS.items() if spec.cuda_graphs] == [2, 3]
    with pytest.raises(ValueError, match=r"opt_level=7 is not available; this build supports 0 \(eager\)"):
        opt_level(7)
    with pytest.raises(Exception):
        OPT_LEVELS[1].compiled = False  # frozen
    assert compile_config_for(CompileConfig(), OPT_LEVELS[3], taps=False).passes.enabled == ("quantize",)
    assert compile_config_for(CompileConfig(), OPT_LEVELS[2], taps=True).passes.taps


def test_enforce_eager_builds_the_eager_level():
    engine = Engine.from_card("tiny-wan", device="cpu", opt_level=2, enforce_eager=True)
    assert engine.opt_level == 0 and engine.compiler is None and engine.projection_cache is not None


# -- loops composed of family parts (docs/loops.md) ----------------------------------------------------


def _fvgraph_classes() -> list[type]:
    """Every class defined in fvgraph's modules (passes/ and cards/ included)."""
    import importlib
    import inspect

    classes = []
    for name in sorted(n for n in _modules() if not n.endswith("__main__")):  # __main__ runs the CLI
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional extra not installed here (Ray Serve): checked where it is
            continue
        classes += [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == name]
    return classes


def _defines_methods(base: type) -> bool:
    """A base that brings behaviour: neither a Protocol, a dataclass, an exception, an enum, nor a
    class from outside fvgraph (nn.Module, BaseModel) whose methods are the library's."""
    import dataclasses
    import enum

    if not base.__module__.startswith("fvgraph") or getattr(base, "_is_protocol", False):
        return False
    if dataclasses.is_dataclass(base) or issubclass(base, BaseException | enum.Enum):
        return False
    return any(callable(v) or isinstance(v, property) for k, v in vars(base).items() if not k.startswith("__"))


def test_no_class_has_two_bases_that_define_methods():
    """Strategies and engine collaborators are parts handed in, not mixins reading a host's privates."""
    for cls in _fvgraph_classes():
        behaving = [b.__name__ for b in cls.__bases__ if _defines_methods(b)]
        assert len(behaving) <= 1, f"{cls.__module__}.{cls.__name__} has bases {behaving}"


def test_no_image_loop_or_state_has_a_video_one_among_its_bases():
    from fvgraph.loops.denoise_state import DenoiseState
    from fvgraph.loops.flux_loop import FluxLoop, FluxState
    from fvgraph.loops.qwen_image_loop import QwenImageLoop, QwenImageState

    from fvgraph.loops.i2v_loop import I2VState
    from fvgraph.loops.ti2v_loop import TI2VState

    video = {loop_class(i) for i in ("t2v", "i2v", "t2v_two_expert", "i2v_two_expert", "ti2v")} | {T2VState, I2VState, TI2VState}
    for image_class in (FluxLoop, QwenImageLoop, FluxState, QwenImageState):
        assert not set(image_class.__mro__) & video, image_class
    assert FluxState.__bases__ == QwenImageState.__bases__ == (DenoiseState,)
    assert not {"decoded_video", "video", "num_frames"} & {f for f in FluxState.__dataclass_fields__}


@pytest.mark.parametrize("card, field, value", [
    ("tiny-wan", "prompt_2", "a second text"),
    ("tiny-wan", "max_sequence_length", 8),
    ("tiny-wan", "image", torch.zeros(64, 64, 3, dtype=torch.uint8)),
    ("tiny-wan", "guidance_scale_2", 3.0),
    ("tiny-wan", "prompt_embeds_mask", torch.ones(4, dtype=torch.int64)),
    ("tiny-flux", "prompt_embeds_mask", torch.ones(4, dtype=torch.int64)),
    ("tiny-flux", "image", torch.zeros(64, 64, 3, dtype=torch.uint8)),
    ("tiny-qwen-image", "prompt_2", "a second text"),
])  # fmt: skip
def test_a_field_only_other_families_read_is_refused_naming_it(card, field, value):
    from fvgraph.request import RequestRejected

    engine = Engine.from_card(card, device="cpu")
    assert field not in engine.loop.reads
    with pytest.raises(RequestRejected, match=rf"^{field}: card '{card}' runs loop '\w+', which takes no {field}; leave it unset"):
        text = {"prompt_embeds": torch.zeros(4, 16)} if field == "prompt_embeds_mask" else {"prompt": "a fox"}  # a mask needs embeddings
        engine.loop.check_request(Request(**text, seed=0, **{field: value}))


def test_a_state_saves_its_phase_as_text_and_refuses_an_unknown_one(tmp_path, tiny_engine):
    from fvgraph.contract.phase import Phase

    state = tiny_engine.start(Request(prompt="x", seed=0, num_inference_steps=2, num_frames=1))
    assert state.phase is Phase.ENCODE and state.phase == "encode"
    state.save(tmp_path / "s.pt")
    saved = torch.load(tmp_path / "s.pt", weights_only=True)
    assert saved["fields"]["phase"] == "encode" and type(saved["fields"]["phase"]) is str
    assert T2VState.load(tmp_path / "s.pt").phase is Phase.ENCODE
    saved["fields"]["phase"] = "warp"
    torch.save(saved, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="field phase: 'warp' is not a valid Phase"):
        T2VState.load(tmp_path / "bad.pt")


def test_a_loop_is_built_complete_from_one_config():
    """The deployment's choices reach the loop at construction (LoopConfig), never set on it after."""
    from fvgraph.caching.calibration_store import CalibrationStore
    from fvgraph.loops.loop_parts import LoopConfig

    engine = Engine.from_card("tiny-wan", device="cpu", cache_methods=["fbcache"], calibration_dir="/tmp/fvgraph-calib")
    loop = engine.loop
    assert loop.step_caching_methods == ("fbcache",) and loop.caching.calibration.root == CalibrationStore("/tmp/fvgraph-calib").root
    assert loop.rollouts.run_facts == {"opt_level": 0, "parallel": "single"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        LoopConfig().step_caching_methods = ()
    source = (PACKAGE / "engine" / "parts.py").read_text()
    assert not re.search(r"\bloop\.\w+ = |hasattr\(loop|isinstance\(loop", source)
