"""Start time of the package itself: `import fvgraph` and `fvgraph --help`, each in a fresh process.

    python perf/bench_import.py                              # 5 interleaved rounds, this tree
    python perf/bench_import.py --against-commit SHA         # A/B: SHA's tree and this one, interleaved

Each round runs every measure below in a fresh Python process, in an order rotated from round to
round (with --against-commit, each measure on both trees; SHA's tree is importable beside this one as
perf/commit_tree.py builds it, first on PYTHONPATH):

    import          `python -X importtime -c "import fvgraph"`: from its report, the cumulative time of
                    the `fvgraph` import (total), of the `torch` import inside it (torch; 0 when it
                    loads none, as the package's names load on first use), and their difference
                    (fvgraph: what the package itself costs on top of torch)
    import_request  the same of `import fvgraph; fvgraph.Request`, what a program that makes requests
                    pays: the request and card schemas, torch with them (total: the package's
                    import and the one `fvgraph.Request` starts, the report's outermost lines)
    help            wall time of `fvgraph --help` (the console script)
    module_help     wall time of `python -m fvgraph --help`

Prints one JSON line per tree and measure (provenance first, fvgraph.perf.method), every figure in
seconds as min / median / max over the rounds (and the 1-minute load average before and after the
rounds: other jobs on the machine slow every figure), then one line per tree naming the heavy modules a
plain `import fvgraph` leaves in sys.modules (diffusers' pipelines and hooks, peft, transformers'
model code; tests/test_light_import.py holds this tree to none).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fvgraph.perf import commit_tree
from fvgraph.perf.method import emit, provenance, spread

# `import time: self [us] | cumulative | <indent>name`, as `python -X importtime` writes each line.
IMPORTTIME_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)")
HEAVY_PREFIXES = ("diffusers.pipelines", "diffusers.hooks", "peft", "transformers.models")
HEAVY_PROBE = (
    "import sys, fvgraph; print(fvgraph.__file__); "
    f"print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] == 'peft' or m.startswith({HEAVY_PREFIXES!r}))))"
)
COMMANDS = {"import": 'python -X importtime -c "import fvgraph"',
            "import_request": 'python -X importtime -c "import fvgraph; fvgraph.Request"',
            "help": "fvgraph --help", "module_help": "python -m fvgraph --help"}  # fmt: skip


def import_seconds(stderr: str) -> dict[str, float]:
    """{"total", "torch", "fvgraph"} seconds from one `-X importtime` report of an fvgraph import: total
    is the cumulative time of the report's outermost fvgraph imports (the package, and a module its
    first use imports after it), torch the first `torch` import's (0 when there is none)."""
    lines = [(len(m[3]), m[4], int(m[2])) for m in map(IMPORTTIME_LINE.match, stderr.splitlines()) if m]
    if not any(name == "fvgraph" for _, name, _ in lines):
        raise RuntimeError("the importtime report names no import of ['fvgraph']")
    outermost = min(indent for indent, _, _ in lines)
    total = sum(us for indent, name, us in lines if indent == outermost and name.split(".")[0] == "fvgraph") / 1e6
    torch_seconds = next((us for _, name, us in lines if name == "torch"), 0) / 1e6
    return {"total": total, "torch": torch_seconds, "fvgraph": total - torch_seconds}


class Tree:
    """One checkout's package, run in fresh processes started in `root` (which `-c` and `-m` put first
    on sys.path); `root` is also put on PYTHONPATH unless it is this checkout (the installed one)."""

    def __init__(self, name: str, root: Path):
        self.name, self.root = name, root
        self.env = dict(os.environ)
        self.env.pop("PYTHONPATH", None)
        if root.resolve() != commit_tree.REPO:
            self.env["PYTHONPATH"] = str(root)

    def run(self, command: list[str]) -> subprocess.CompletedProcess:
        done = subprocess.run(command, capture_output=True, text=True, env=self.env, cwd=self.root)
        if done.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")
        return done

    def measure(self, name: str) -> dict[str, float]:
        if name.startswith("import"):
            code = COMMANDS[name].split(" -c ")[1].strip('"')
            return import_seconds(self.run([sys.executable, "-X", "importtime", "-c", code]).stderr)
        command = {"help": [str(Path(sys.executable).parent / "fvgraph"), "--help"],
                   "module_help": [sys.executable, "-m", "fvgraph", "--help"]}[name]  # fmt: skip
        began = time.perf_counter()
        self.run(command)
        return {"wall": time.perf_counter() - began}

    def heavy_modules(self) -> tuple[str, list[str]]:
        """(the file `import fvgraph` loaded, the heavy modules it left in sys.modules)."""
        first, *heavy = self.run([sys.executable, "-c", HEAVY_PROBE]).stdout.split()
        return first, heavy


def measure_trees(trees: list[Tree], repeats: int) -> dict[tuple[str, str], list[dict[str, float]]]:
    """`repeats` rounds of every (tree, measure), the order rotated by one each round."""
    cases = [(tree, name) for name in COMMANDS for tree in trees]
    samples = {(tree.name, name): [] for tree, name in cases}
    for round_index in range(repeats):
        shift = round_index % len(cases)
        for tree, name in cases[shift:] + cases[:shift]:
            samples[(tree.name, name)].append(tree.measure(name))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds (fresh processes per measure and tree)")
    parser.add_argument("--against-commit", metavar="SHA", help="also measure this commit's tree, interleaved (A/B)")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats={args.repeats} must be >= 1")
    head = provenance("import", torch.device("cpu"))
    with tempfile.TemporaryDirectory(prefix="fvgraph-import-") as tmp:
        trees, commits = [Tree("this", commit_tree.REPO)], {"this": head["commit"]}
        if args.against_commit:
            sha = commit_tree.resolve_commit(args.against_commit)
            trees.insert(0, Tree("base", commit_tree.materialize(sha, Path(tmp))))
            commits["base"] = sha[:12]
        load_before = os.getloadavg()[0]
        samples = measure_trees(trees, args.repeats)
        load = {"load_average_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}}
        for (tree, name), runs in samples.items():
            figures = {key: spread([run[key] for run in runs]) for key in runs[0]}
            emit({**head, "tree": tree, "tree_commit": commits[tree], "measure": name, "command": COMMANDS[name],
                  "seconds": figures, **load})  # fmt: skip
        for tree in trees:
            loaded_from, heavy = tree.heavy_modules()
            if tree.root.resolve() not in Path(loaded_from).resolve().parents:
                raise RuntimeError(f"{tree.name}: `import fvgraph` loaded {loaded_from}, outside its tree {tree.root}")
            emit({**head, "tree": tree.name, "tree_commit": commits[tree.name], "measure": "heavy_modules_after_import",
                  "fvgraph_file": loaded_from, "prefixes": list(HEAVY_PREFIXES), "loaded": len(heavy), "first": heavy[:8]})  # fmt: skip


if __name__ == "__main__":
    main()
