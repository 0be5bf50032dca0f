"""A compiled step graph as a file, and back: what the capture cache stores for each signature.

- inductor: an AOTInductor package (.pt2). It holds the generated code already built into a shared
  library (and, on a GPU, the kernels' binaries), so loading it runs no compiler at all. torch's own
  cache artifacts (`torch.compiler.save_cache_artifacts`) keep the generated source but, on a CPU, not
  the built C++, so loading them still runs g++ once per kernel; the package does not.
- eager / aot_eager: the post-pass graph as a `torch.export` program. Loading it skips dynamo capture
  and the FX passes; the backend (cheap for these two) runs again on the loaded graph.

On a GPU a freshly built package is first loaded in a child process (`load_in_child`): torch
2.11's AOTInductor loader was seen to die of SIGSEGV on an H200 loading a package fvgraph had just
built, and a crash there should cost the child and one logged in-process compile, not the server.

Either way the graph's calling convention is kept: flat positional tensors in, a sequence of tensors out.
The process that writes an artifact runs it through `load_graph` too, so a warm process runs the very
same code as the one that warmed the cache.
"""

from __future__ import annotations

import inspect
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import fx

GraphFn = Callable[..., "tuple[torch.Tensor, ...] | list[torch.Tensor]"]


def save_graph(gm: fx.GraphModule, example_args: list[torch.Tensor], backend: str, path: Path,
               inductor_patches: dict) -> None:  # fmt: skip
    """Write `gm` (flat tensors in, tuple out) to `path` in the form `backend` loads fastest."""
    with torch.no_grad():
        # strict=False: the graph is already a flat FX graph, there is no Python to trace any more.
        program = torch.export.export(gm, tuple(example_args), strict=False)
        if backend == "inductor":
            with torch._inductor.config.patch(inductor_patches):
                torch._inductor.aoti_compile_and_package(program, package_path=str(path))
        else:
            torch.export.save(program, str(path))


def load_graph(path: Path, backend: str, device: torch.device, compile_fn: Callable[[fx.GraphModule, list], GraphFn],
               example_args: list[torch.Tensor] | None = None) -> GraphFn:  # fmt: skip
    """The callable stored at `path`. For eager/aot_eager, `compile_fn(gm, example_args)` runs the
    backend on the loaded graph (example_args may be meta tensors shaped like the real inputs)."""
    if backend == "inductor":
        # run_single_threaded: no locking around a run, which CUDA graph capture needs (and a
        # GraphRunner never runs one graph from two threads).
        options = {"run_single_threaded": True}
        if "device_index" in inspect.signature(torch._inductor.aoti_load_package).parameters:
            options["device_index"] = device.index if device.type == "cuda" and device.index is not None else -1
        return torch._inductor.aoti_load_package(str(path), **options)
    gm = torch.export.load(str(path)).module()
    return compile_fn(gm, example_args or [])


def probe_load(path: Path, backend: str) -> None:
    """Load the artifact at `path` as a serving process would, and drop it; raises when it will not
    load (a file whose hash checks out can still fail to load: a library it links against changed)."""
    if backend == "inductor":
        options = {"run_single_threaded": True}
        if "device_index" in inspect.signature(torch._inductor.aoti_load_package).parameters:
            options["device_index"] = 0 if torch.cuda.is_available() else -1
        torch._inductor.aoti_load_package(str(path), **options)
    else:
        torch.export.load(str(path)).module()


# What the child runs: load each artifact the way load_graph does, then exit 0.
_CHILD = """
import sys, torch
from fvgraph.compile.graph_artifact import load_graph
backend, device = sys.argv[1], torch.device(sys.argv[2])
for path in sys.argv[3:]:
    load_graph(path, backend, device, lambda gm, args: gm)
"""


def load_in_child(paths: Iterable[Path], backend: str, device: torch.device, timeout_s: float = 300.0) -> str | None:
    """Load the artifacts at `paths` in a fresh Python process. None when they all load; otherwise
    what happened to the child (its exit code or the signal that killed it, and its last stderr)."""
    command = [sys.executable, "-c", _CHILD, backend, str(device), *(str(p) for p in paths)]
    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"loading took over {timeout_s:.0f} s in a child process"
    if child.returncode == 0:
        return None
    how = (f"killed by {signal.Signals(-child.returncode).name}" if child.returncode < 0
           else f"exit code {child.returncode}")  # fmt: skip
    tail = child.stderr.strip().splitlines()[-3:]
    return f"a child process loading it ended with {how}" + (": " + " | ".join(tail) if tail else "")
