"""A compiled step graph as a file, and back: what the capture cache stores for each signature.

The artifact kinds (`artifact_kind` picks one from the backend and the capture cache's format):
- standalone (inductor, the default format): inductor's own standalone artifact
  (`torch._inductor.standalone_compile` of the post-pass graph, saved in its "binary" form). It
  holds the generated wrapper code and, on a GPU, the Triton kernels' binaries; loading it
  (`CompiledArtifact.load`) needs no AOTInductor runtime and runs no inductor compile. On a CPU the
  kernels are C++ source, built with g++ once per kernel by the first load into an inductor cache.
  torch's loader also refuses an artifact written by another torch (its `torch_key`).
- inductor (the `aoti` format): an AOTInductor package (.pt2). It holds the generated code already
  built into a shared library (and, on a GPU, the kernels' binaries), so loading it runs no compiler
  at all, on a CPU either.
- eager / aot_eager: the post-pass graph as a `torch.export` program. Loading it skips dynamo capture
  and the FX passes; the backend (cheap for these two) runs again on the loaded graph.

On a GPU, AOTInductor work that could crash the process runs in a child process first: a package
is built in one (`save_graph_in_child`), and loaded in one (`load_in_child`) after it is built and
before the first in-process load of a capture-cache hit. torch 2.11's AOTInductor loader was seen to
die of SIGSEGV on an H200 loading a package fvgraph had just built; a crash there should cost the
child and one logged in-process compile, not the server. Each child runs with faulthandler on (a
crash prints its Python stack) under a time limit, and every load logs a line first, so the last
line before a crash names the file. Standalone artifacts are built and loaded in process: they
run the code an in-process compile runs.

Either way the graph's calling convention is kept: flat positional tensors in, a sequence of tensors out.
The process that writes an artifact runs it through `load_graph` too, so a warm process runs the very
same code as the one that warmed the cache.
"""

from __future__ import annotations

import logging
import pickle
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import fx

log = logging.getLogger(__name__)
CHILD_LOAD_TIMEOUT_S = 120.0  # a load that takes longer is treated as failed (the step compiles in process)
CHILD_BUILD_TIMEOUT_S = 480.0  # an AOTInductor build took 72 s on an H200 for a one-layer graph

GraphFn = Callable[..., "tuple[torch.Tensor, ...] | list[torch.Tensor]"]
# How the capture cache stores inductor graphs. "auto", the default: inductor's standalone artifact on a
# GPU (it loads with no AOTInductor runtime, whose loader died of SIGSEGV on an H200: docs/gpu.md), an
# AOTInductor package on a CPU (a standalone artifact holds C++ source there, rebuilt by g++ at every
# first load into an empty inductor cache: docs/capture_cache.md, "Measured").
ARTIFACT_FORMATS = ("auto", "standalone", "aoti")
SUFFIX = {"standalone": ".bin"}  # file suffix by artifact kind; .pt2 otherwise (packages, export programs)


def artifact_kind(backend: str, artifact_format: str, device_type: str = "cpu") -> str:
    """What a graph compiled with `backend` on `device_type` is stored as: "standalone", "inductor" (an
    AOTInductor package) or the backend itself (a torch.export program for eager / aot_eager)."""
    if artifact_format not in ARTIFACT_FORMATS:
        raise ValueError(f"artifact_format={artifact_format!r} must be one of {', '.join(ARTIFACT_FORMATS)}")
    if artifact_format == "auto":
        artifact_format = "standalone" if device_type == "cuda" else "aoti"
    return "standalone" if backend == "inductor" and artifact_format == "standalone" else backend


def save_graph(gm: fx.GraphModule, example_args: list[torch.Tensor], backend: str, path: Path,
               inductor_patches: dict) -> None:  # fmt: skip
    """Write `gm` (flat tensors in, tuple out) to `path` as the artifact kind `backend` (artifact_kind)."""
    with torch.no_grad():
        if backend == "standalone":  # shapes as given: a signature is one shape and batch bucket
            _with_example_values(gm, example_args)
            artifact = torch._inductor.standalone_compile(gm, list(example_args), dynamic_shapes="from_example_inputs",
                                                          options={"config_patches": inductor_patches})  # fmt: skip
            artifact.save(path=str(path), format="binary")
            return
        # strict=False: the graph is already a flat FX graph, there is no Python to trace any more.
        program = torch.export.export(gm, tuple(example_args), strict=False)
        if backend == "inductor":
            with torch._inductor.config.patch(inductor_patches):
                torch._inductor.aoti_compile_and_package(program, package_path=str(path))
        else:
            torch.export.save(program, str(path))


def _with_example_values(gm: fx.GraphModule, example_args: list[torch.Tensor]) -> None:
    """Give every node the `example_value` dynamo's own graphs carry: AOTAutograd's cache, which a
    standalone artifact is made of, stores no graph with a tensor method call (`x.isfinite()`) on a
    node without one. Nodes the passes added have no value yet: fake propagation supplies them."""
    if any(node.op != "output" and "val" not in node.meta for node in gm.graph.nodes):
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*example_args)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta.setdefault("example_value", node.meta["val"])


def load_graph(path: Path, backend: str, device: torch.device, compile_fn: Callable[[fx.GraphModule, list], GraphFn],
               example_args: list[torch.Tensor] | None = None) -> GraphFn:  # fmt: skip
    """The callable stored at `path`. For eager/aot_eager, `compile_fn(gm, example_args)` runs the
    backend on the loaded graph (example_args may be meta tensors shaped like the real inputs)."""
    log.info("loading the %s artifact %s on %s", backend, path, device)
    if backend == "standalone":
        return torch._inductor.CompiledArtifact.load(path=str(path), format="binary")
    if backend == "inductor":
        return open_package(path, device.index if device.type == "cuda" and device.index is not None else -1)
    gm = torch.export.load(str(path)).module()
    return compile_fn(gm, example_args or [])


def open_package(path: Path, device_index: int) -> GraphFn:
    """The AOTInductor package at `path`, opened by torch's package loader directly.

    `aoti_load_package` would first compare the device facts the package records with this
    process's, only to log a warning on a mismatch; on every device those include inductor's CPU
    ISA, `pick_vec_isa()`, which builds and loads probe programs with g++ (about 8 s on a 2-core
    machine with an empty inductor cache, most of a warm start). A capture cache never offers a
    package built for another CPU (its fingerprint holds `cpu_isa`), so the check is skipped, the way
    `torch._inductor.package.load_package` opens a package without metadata."""
    from torch._inductor.package.package import AOTICompiledModel

    # run_single_threaded: no locking around a run, which CUDA graph capture needs (and a
    # GraphRunner never runs one graph from two threads). One runner, as aoti_load_package makes.
    return AOTICompiledModel(torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1, device_index))


def probe_load(path: Path, backend: str) -> None:
    """Load the artifact at `path` as a serving process would, and drop it; raises when it will not
    load (a file whose hash checks out can still fail to load: a library it links against changed)."""
    if backend == "standalone":
        torch._inductor.CompiledArtifact.load(path=str(path), format="binary")
    elif backend == "inductor":
        open_package(path, 0 if torch.cuda.is_available() else -1)
    else:
        torch.export.load(str(path)).module()


def register_custom_ops() -> None:
    """Import the modules that register fvgraph's custom ops: a child process loading or building a
    graph that calls them needs them registered (a process running fvgraph has them already)."""
    import fvgraph.contract.block_copies  # noqa: F401
    import fvgraph.contract.markers  # noqa: F401
    import fvgraph.kernels.fp8_linear  # noqa: F401
    import fvgraph.kernels.norm_modulate  # noqa: F401
    import fvgraph.loops.taps  # noqa: F401


# The children start with fvgraph's custom ops registered.
_OPS = "from fvgraph.compile.graph_artifact import register_custom_ops\nregister_custom_ops()\n"
# What a load child runs: load each artifact the way load_graph does, then exit 0.
_CHILD = _OPS + """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from fvgraph.compile.graph_artifact import load_graph
backend, device = sys.argv[1], torch.device(sys.argv[2])
for path in sys.argv[3:]:
    load_graph(path, backend, device, lambda gm, args: gm)
"""

# What a build child runs: the exported program and the inductor patches (pickled) to an AOTInductor package.
_BUILD_CHILD = _OPS + """
import pickle, sys, torch
from fvgraph.compile.compiled_block_copies import register_lowerings
register_lowerings()  # block offload's copies lower with their readers first
program = torch.export.load(sys.argv[1])
with open(sys.argv[2], "rb") as handle:
    patches = pickle.load(handle)
with torch._inductor.config.patch(patches):
    torch._inductor.aoti_compile_and_package(program, package_path=sys.argv[3])
"""


def _run_child(script: str, args: list[str], timeout_s: float, doing: str) -> str | None:
    """Run `script` in a fresh Python with faulthandler on. None when it exits 0; otherwise what
    happened to it (its exit code or the signal that killed it, and its last stderr lines)."""
    command = [sys.executable, "-X", "faulthandler", "-c", script, *args]
    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"{doing} took over {timeout_s:.0f} s in a child process"
    if child.returncode == 0:
        return None
    how = (f"killed by {signal.Signals(-child.returncode).name}" if child.returncode < 0
           else f"exit code {child.returncode}")  # fmt: skip
    said = _last_words(child.stderr)
    return f"a child process {doing} ended with {how}" + (": " + said if said else "")


def _last_words(stderr: str) -> str:
    """What a failed child said, on one line: after a crash, faulthandler's report (the error and the
    whole Python stack, most recent call first) with the line logged before it, which names the file;
    without faulthandler's list of extension modules, which says nothing about the crash. Otherwise
    its last three lines (a traceback's error)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not line.startswith("Extension modules:")]
    fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None)
    said = lines[-3:] if fatal is None else lines[max(fatal - 1, 0):]
    return " | ".join(said)


def load_in_child(paths: Iterable[Path], backend: str, device: torch.device, timeout_s: float = CHILD_LOAD_TIMEOUT_S) -> str | None:
    """Load the artifacts at `paths` in a fresh Python process. None when they all load; otherwise
    what happened to the child (its exit code or the signal that killed it, and its last stderr)."""
    paths = [str(p) for p in paths]
    log.info("loading %s in a child process first (limit %.0f s)", ", ".join(paths), timeout_s)
    return _run_child(_CHILD, [backend, str(device), *paths], timeout_s, "loading it")


def save_graph_in_child(gm: fx.GraphModule, example_args: list[torch.Tensor], path: Path, inductor_patches: dict,
                        timeout_s: float = CHILD_BUILD_TIMEOUT_S) -> None:  # fmt: skip
    """save_graph for the inductor backend, with the AOTInductor build in a child process: the graph
    is exported here and built there. Raises RuntimeError saying what happened to a child that failed."""
    with torch.no_grad():
        program = torch.export.export(gm, tuple(example_args), strict=False)
    with tempfile.TemporaryDirectory(prefix="fvgraph-build-") as scratch:
        exported, patches = Path(scratch) / "program.pt2", Path(scratch) / "patches.pkl"
        torch.export.save(program, str(exported))
        patches.write_bytes(pickle.dumps(inductor_patches))
        log.info("building the AOTInductor package %s in a child process (limit %.0f s)", path, timeout_s)
        problem = _run_child(_BUILD_CHILD, [str(exported), str(patches), str(path)], timeout_s, "building it")
    if problem is not None:
        raise RuntimeError(f"the AOTInductor package {path} was not built: {problem}")
