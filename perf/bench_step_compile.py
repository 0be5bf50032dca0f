"""Compile seconds of one guided (CFG) denoise step, each compile in a fresh process.

    python perf/bench_step_compile.py                      # tiny-wan, -O1 aot_eager, batch 1, 5 processes
    python perf/bench_step_compile.py --repeats 3 --backend inductor
    python perf/bench_step_compile.py --against-commit SHA    # SHA's tree and this one, interleaved

Each repeat is a new Python process (nothing traced or compiled before it) that builds the card's
engine at -O1 with the chosen backend, compiling only the `denoise_cfg` kind, and serves one guided
request of one step at batch bucket 1: exactly one compile. It reports that compile's seconds as the
engine's `Counters.compile_seconds` counts them (capture, passes and backend), and how many graphs
dynamo traced in the process (`torch._dynamo.utils.counters["stats"]["unique_graphs"]`). Prints one
JSON line: fvgraph.perf.method's provenance, then each figure as min / median / max over the
processes. With `--against-commit SHA` each round runs one process on SHA's tree (perf/commit_tree.py)
and one on this tree, in an order that alternates from round to round, so a neighbour's load hits
both alike; the line then holds both sides and `this_over_base`, the ratio of the two compiles of
each round, with the same spread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from fvgraph.perf import commit_tree
from fvgraph.perf.method import emit, paired_ratio, provenance, spread

CHILD = """
import json, os, sys
root = os.environ.get("FVGRAPH_TREE")
if root:  # another commit's tree: drop this checkout's editable finder (perf/commit_tree.py, isolate)
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable___fvgraph")]
import torch
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
a = json.loads(sys.argv[1])
engine = Engine.from_card(a["card"], device="cpu", opt_level=1,
                          compile_config=CompileConfig(backend=a["backend"], step_kinds=("denoise_cfg",)))
[result] = engine.generate([Request(prompt="a lantern", seed=5, guidance_scale=5.0, num_inference_steps=1,
                                    num_frames=5, output_type="latent")])
stats = torch._dynamo.utils.counters["stats"]
if root:
    foreign = [n for n, m in list(sys.modules.items()) if n.split(".")[0] == "fvgraph" and getattr(m, "__file__", None)
               and not os.path.realpath(m.__file__).startswith(os.path.realpath(root))]
    assert not foreign, f"modules from outside {root}: {foreign}"
print(json.dumps({"status": result.status, "compiles": engine.counters.compiles,
                  "compile_seconds": engine.counters.compile_seconds, "unique_graphs": stats["unique_graphs"]}))
"""


def one_process(card: str, backend: str, tree: Path | None = None) -> dict:
    """One fresh process's compile (on another commit's `tree`, or this checkout): its counters."""
    args = json.dumps({"card": card, "backend": backend})
    env = dict(os.environ)
    if tree is not None:
        env.update(FVGRAPH_TREE=str(tree), PYTHONPATH=os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")])))
    # `python -c` puts the working directory first on sys.path: the tree's own, so only it is importable
    done = subprocess.run([sys.executable, "-c", CHILD, args], capture_output=True, text=True, timeout=1800, env=env,
                          cwd=tree or commit_tree.REPO)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the child process failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if out["status"] != "ok" or out["compiles"] != 1:
        raise SystemExit(f"expected one finished request and one compile, got {out}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--card", default="tiny-wan")
    parser.add_argument("--backend", default="aot_eager", choices=("eager", "aot_eager", "inductor"))
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes (per side), one compile each")
    parser.add_argument("--against-commit", help="also compile on this commit's tree, interleaved")
    args = parser.parse_args()
    line = {**provenance("step_compile", torch.device("cpu")), "card": args.card, "step_kind": "denoise_cfg",
            "opt_level": 1, "backend": args.backend, "batch": 1}  # fmt: skip
    if args.against_commit is None:
        runs = [one_process(args.card, args.backend) for _ in range(args.repeats)]
        emit({**line, **_side(runs)})
        return
    sha = commit_tree.resolve_commit(args.against_commit)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"base": commit_tree.materialize(sha, Path(tmp)), "this": None}
        runs = {"base": [], "this": []}
        for r in range(args.repeats):
            for side in (("base", "this") if r % 2 == 0 else ("this", "base")):
                runs[side].append(one_process(args.card, args.backend, trees[side]))
    this, base = ([run["compile_seconds"] for run in runs[side]] for side in ("this", "base"))
    emit({**line, "against_commit": sha[:12], "base": _side(runs["base"]), "this": _side(runs["this"]),
          "this_over_base": paired_ratio(this, base)})  # fmt: skip


def _side(runs: list[dict]) -> dict:
    return {"compile_seconds": spread([r["compile_seconds"] for r in runs]),
            "dynamo_graphs_per_process": sorted({r["unique_graphs"] for r in runs})}  # fmt: skip


if __name__ == "__main__":
    main()
