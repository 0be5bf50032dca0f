"""Why an AOTInductor package fvgraph built on a GPU does not load: the packages, and each way to load them.

    OUT=/tmp/probe python perf/aoti_load_probe.py      # on a CUDA machine; writes into $OUT

It warms tiny-wan at -O2 (inductor, bucket 1) through a fresh capture cache, as the capture-cache GPU
test does, and stops at the first child load of the packages it built. There it copies the packages
into $OUT and loads them in fresh processes, one way per process: as the capture cache does, with
CUDA initialised and an explicit device index first, through torch's `aoti_load_package`, each
package alone, and under gdb when the machine has it (for the C++ stack). Each way's exit status and
full stderr go to $OUT; one JSON line sums them up.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(os.environ.get("OUT", "aoti-load-probe"))

_HEAD = "from fvgraph.compile.graph_artifact import register_custom_ops\nregister_custom_ops()\nimport sys, torch\n"
WAYS = {
    "as_served": _HEAD + "from fvgraph.compile.graph_artifact import open_package\n"
                         "for p in sys.argv[1:]: open_package(p, -1)\n",
    "cuda_initialised_index0": _HEAD + "torch.zeros(1, device='cuda:0'); torch.cuda.synchronize()\n"
                                       "from fvgraph.compile.graph_artifact import open_package\n"
                                       "for p in sys.argv[1:]: open_package(p, 0)\n",
    "aoti_load_package": _HEAD + "for p in sys.argv[1:]: torch._inductor.aoti_load_package(p)\n",
    "no_custom_ops": "import sys, torch\nfrom torch._inductor.package.package import AOTICompiledModel\n"
                     "for p in sys.argv[1:]: AOTICompiledModel(torch._C._aoti.AOTIModelPackageLoader(p, 'model', True, 1, -1))\n",
}


def _child(name: str, command: list[str]) -> dict:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=90)
        (OUT / f"{name}.log").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
        return {"rc": done.returncode}
    except subprocess.TimeoutExpired:
        return {"rc": "timeout"}


def probe(paths, backend, device, timeout_s=None):
    paths = [Path(p) for p in paths]
    for p in paths:
        shutil.copy(p, OUT / p.name)
    ways = {}
    for name, script in WAYS.items():
        ways[name] = _child(name, [sys.executable, "-X", "faulthandler", "-c", script, *map(str, paths)])
    for p in paths:  # each package alone
        ways[f"alone_{p.stem}"] = _child(f"alone_{p.stem}", [sys.executable, "-X", "faulthandler", "-c", WAYS["as_served"], str(p)])
    gdb = shutil.which("gdb")
    if gdb:
        ways["gdb"] = _child("gdb", [gdb, "-batch", "-ex", "run", "-ex", "bt 40", "--args", sys.executable, "-c",
                                     WAYS["as_served"], *map(str, paths)])  # fmt: skip
    print(json.dumps({"bench": "aoti_load_probe", "gdb": bool(gdb), "packages": {p.name: p.stat().st_size for p in paths},
                      "ways": ways}), flush=True)  # fmt: skip
    os._exit(0)


def main() -> None:
    import torch

    from fvgraph.compile import compiler
    from fvgraph.compile.compiler import CompileConfig
    from fvgraph.engine.engine import Engine
    from fvgraph.request import Request
    from fvgraph.runtime.buckets import BucketSpec

    OUT.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU: a rehearsal of the script itself
    compiler.load_in_child = probe
    compiler.StepCompiler._aoti_in_child = True
    with tempfile.TemporaryDirectory() as cache:
        engine = Engine.from_card("tiny-wan", device=device, opt_level=2, compile_config=CompileConfig(backend="inductor"),
                                  cache_dir=cache, buckets=BucketSpec(batch_sizes=(1,)))  # fmt: skip
        engine.warmup([Request(prompt="a red fox", seed=1, num_inference_steps=4, num_frames=9)])
    print(json.dumps({"bench": "aoti_load_probe", "error": "no package was built"}))


if __name__ == "__main__":
    main()
