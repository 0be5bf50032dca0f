"""Another commit's fvgraph, importable beside this one, and benchmark workers that run on either.

A comparison across commits (fvgraph.perf.method) re-measures the old commit with the current
method, interleaved with the current tree in one run. The old commit's files come from
`git archive` into a hidden folder of a temporary one (the repository's worktree list is left
alone); its `fvgraph/` moves up into the temporary folder and its other top-level folders are linked
under it as its own pyproject's `package-dir` maps them (`fvgraph.cards` -> `cards/`, ...), so with
the temporary folder first on PYTHONPATH `import fvgraph` is the old commit's, and nothing else there
is importable: an old top-level `kernels/` would shadow Hugging Face's `kernels`, which transformers
imports. Each side runs in a worker process of its own, which answers one JSON line per command
on stdin; a worker refuses to run when any fvgraph module it loaded lies outside its tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tomllib
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def resolve_commit(ref: str, repo: Path = REPO) -> str:
    """The full SHA of `ref`; ValueError naming the ref when the repository does not have it."""
    out = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], cwd=repo, capture_output=True, text=True)
    if out.returncode != 0:
        raise ValueError(f"--against-commit={ref!r} is not a commit of the repository at {repo}")
    return out.stdout.strip()


def materialize(sha: str, dest: Path, repo: Path = REPO) -> Path:
    """The tree of commit `sha` under `dest`, importable as `fvgraph` (and as nothing else) with `dest`
    on PYTHONPATH: the tree in `dest/.tree` (a name no import can reach), its fvgraph/ in `dest`."""
    tree = dest / ".tree"
    archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=repo, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    (tree / "fvgraph").rename(dest / "fvgraph")
    package_dir = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"].get("package-dir", {})
    for package, folder in package_dir.items():
        parts = package.split(".")
        if parts[0] != "fvgraph" or len(parts) != 2:
            continue  # "fvgraph" itself is dest/fvgraph already
        link = dest / "fvgraph" / parts[1]
        if not link.exists():
            link.symlink_to(tree / folder, target_is_directory=True)
    return dest


def isolate(root: Path) -> None:
    """In a worker on another tree: drop the import finder of this checkout's editable install, which
    would otherwise answer for any fvgraph module that tree lacks (a silent mix of two commits)."""
    if root.resolve() != REPO:
        sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable___fvgraph")]


def foreign_modules(root: Path) -> list[str]:
    """Loaded fvgraph modules whose file is not under `root` (a mixed import of two trees)."""
    root = root.resolve()
    foreign = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if (name == "fvgraph" or name.startswith("fvgraph.")) and path and root not in Path(path).resolve().parents:
            foreign.append(f"{name} ({path})")
    return foreign


class Worker:
    """A benchmark worker process on one tree: `python script --worker ...` with that tree first on
    PYTHONPATH; `ask(command)` sends one line and returns the worker's JSON answer."""

    def __init__(self, name: str, root: Path, script: Path, args: list[str]):
        self.name = name
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        self.process = subprocess.Popen(
            [sys.executable, str(script), "--worker", "--worker-root", str(root), *args],
            cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def read(self) -> dict:
        """The worker's next JSON line (its other output, e.g. compile logs, is skipped)."""
        for line in self.process.stdout:
            if line.startswith("{"):
                answer = json.loads(line)
                if "error" in answer:
                    raise RuntimeError(f"{self.name} worker: {answer['error']}")
                return answer
        raise RuntimeError(f"{self.name} worker exited (code {self.process.wait()}) before answering")

    def ask(self, command: str) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        """End of input: the worker exits; one that does not within a minute is killed."""
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
