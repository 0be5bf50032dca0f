"""The docs name only what the code has: every file path, every `fvgraph::` op and every pass they name;
and no doc or code file names a bare top-level-style file (README.md, pyproject.toml, a .sh) that the
repository does not hold."""

import re
from pathlib import Path

import pytest
import torch

import fvgraph.kernels.fp8_linear  # noqa: F401  (the modules that register fvgraph:: ops)
import fvgraph.kernels.norm_modulate  # noqa: F401
import fvgraph.contract.markers  # noqa: F401
import fvgraph.loops.taps  # noqa: F401
from fvgraph.passes.manager import FX_PASSES, OPT_IN

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "capture_cache" / "README.md",
               ROOT / "perf" / "results" / "README.md"])  # fmt: skip
# The project's own files, docs and code: where a bare file name may be cited.
SOURCES = sorted({*DOCS, *(p for folder in ("fvgraph", "passes", "perf", "cards", "tests", "capture_cache")
                           for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", ".md") and p.is_file()),
                  ROOT / "pyproject.toml", ROOT / "Makefile"})  # fmt: skip
# A file name with no folder before it, of the kinds that sit at a repository's top (.md, .toml, .sh).
BARE = re.compile(r"(?<![\w./-])[\w-]+\.(?:md|toml|sh)\b")
PATH = re.compile(r"\b(?:fvgraph|passes|kernels|perf|tests|cards|docs|capture_cache)/[\w./-]*\w\.(?:py|md|sh|jsonl)\b")


def _mentions(pattern: re.Pattern) -> list[tuple[str, str]]:
    return [(doc.relative_to(ROOT).as_posix(), m.group(0)) for doc in DOCS for m in pattern.finditer(doc.read_text())]


def test_docs_are_found():
    assert all(doc.is_file() for doc in DOCS) and len(DOCS) > 5


@pytest.mark.parametrize("doc, path", sorted(set(_mentions(PATH))))
def test_every_named_file_exists(doc, path):
    assert (ROOT / path).exists(), f"{doc} names {path}, which does not exist"


def _bare_names() -> list[tuple[str, str]]:
    held = {p.name for p in SOURCES} | {p.name for p in ROOT.iterdir()}
    cited = {(source.relative_to(ROOT).as_posix(), m.group(0)) for source in SOURCES for m in BARE.finditer(source.read_text())}
    return sorted((source, name) for source, name in cited if name not in held)


def test_no_file_names_a_file_the_repository_lacks():
    assert _bare_names() == [], "these cite a file that is not in the repository (quote what it said instead)"


@pytest.mark.parametrize("doc, op", sorted(set(_mentions(re.compile(r"fvgraph::\w+")))))
def test_every_named_op_is_registered(doc, op):
    assert hasattr(torch.ops.fvgraph, op.split("::")[1]), f"{doc} names {op}, which no module registers"


def test_the_pass_table_names_the_registered_passes():
    table = (ROOT / "docs" / "compile.md").read_text().split("## Passes", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| `(\w+)`(?: \(tail\))? \| (\S+) \|", table, flags=re.M)
    named = {name for name, _ in rows}
    assert named <= set(FX_PASSES) | {"cleanup"} and set(FX_PASSES) - OPT_IN <= named, named
    assert all((ROOT / path).is_file() for _, path in rows)


def test_the_kernel_table_names_registered_ops():
    table = (ROOT / "docs" / "kernels.md").read_text().split("| op |", 1)[1].split("\n\n", 1)[0]
    ops = re.findall(r"^\| `(\w+)\(", table, flags=re.M)
    assert ops and [op for op in ops if not hasattr(torch.ops.fvgraph, op)] == []
