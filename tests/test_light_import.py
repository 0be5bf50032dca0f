"""`import fvgraph` and `fvgraph --help` load none of the heavy code a card brings: no diffusers
pipeline or hook module, no peft, no transformers model code. Those load when a card is built or an
engine is made (docs/architecture.md, "What loads when"). Each check runs in a fresh interpreter, so
nothing this test session imported counts."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# What must stay out of sys.modules: whole packages (the name and everything under it).
HEAVY = ("peft", "diffusers.hooks", "diffusers.pipelines", "transformers.models")

LOADED_HEAVY = textwrap.dedent(f"""
    import json, sys
    heavy = {HEAVY!r}
    print(json.dumps(sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))))
""")

IMPORT = "import fvgraph\n" + LOADED_HEAVY
# What `fvgraph ARGS` runs (the console script calls fvgraph.cli's app), then the check.
HELP = textwrap.dedent("""
    import contextlib, io, sys
    sys.argv = ["fvgraph", *ARGS]
    from fvgraph.cli import app
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        app(prog_name="fvgraph")
    assert "Usage: fvgraph" in out.getvalue(), out.getvalue()
""") + LOADED_HEAVY
MODULE_HELP = HELP.replace("from fvgraph.cli import app", "import runpy").replace(
    'app(prog_name="fvgraph")', 'runpy.run_module("fvgraph", run_name="__main__")'
)
# A command's help is read from its options alone: no card, request schema or tensor library behind them.
HELP_ONLY_LOADS_NO = ("torch", "numpy")


def _help(args: list[str], code: str = HELP) -> str:
    """`code` (HELP or MODULE_HELP) run as `fvgraph *args`."""
    return code.replace("*ARGS", ", ".join(map(repr, args)))


def _heavy_modules_after(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("code", [IMPORT, _help(["--help"]), _help(["--help"], MODULE_HELP)],
                         ids=["import fvgraph", "fvgraph --help", "python -m fvgraph --help"])  # fmt: skip
def test_loads_no_pipeline_hook_peft_or_transformers_model_code(code):
    assert _heavy_modules_after(code) == []


@pytest.mark.parametrize("args, code", [(["--help"], HELP), (["--help"], MODULE_HELP), (["generate", "--help"], HELP),
                                        (["serve", "--help"], HELP), (["cache", "ls", "--help"], HELP)],
                         ids=["fvgraph --help", "python -m fvgraph --help", "fvgraph generate --help",
                              "fvgraph serve --help", "fvgraph cache ls --help"])  # fmt: skip
def test_help_loads_no_torch_or_numpy(args, code):
    """Help is the commands' options and words: torch's import alone (seconds on a loaded CPU) would be
    most of its time (issue 50: `fvgraph --help` under 1.5 s)."""
    check = f"print(json.dumps(sorted(m for m in {HELP_ONLY_LOADS_NO!r} if m in sys.modules)))"
    assert _heavy_modules_after(_help(args, code) + check) == []


def test_building_a_card_still_loads_what_it_needs():
    """The check itself sees heavy modules when they are loaded: making tiny-wan's engine brings
    diffusers' model code, whose loader imports the hooks."""
    code = "import fvgraph\nfvgraph.Engine.from_card('tiny-wan', device='cpu')\n" + LOADED_HEAVY
    assert "diffusers.hooks" in _heavy_modules_after(code)


def test_every_public_name_loads_from_its_module_on_first_use():
    import fvgraph
    from fvgraph.artifacts import ImageArtifact, LatentArtifact, Provenance, VideoArtifact
    from fvgraph.card import ModelCard
    from fvgraph.cards import card_names, get_card
    from fvgraph.engine.engine import Engine
    from fvgraph.events import PreviewEvent
    from fvgraph.parallel.config import ParallelConfig
    from fvgraph.request import Request, RequestRejected, Result

    homes = {"Engine": Engine, "ModelCard": ModelCard, "ParallelConfig": ParallelConfig, "Request": Request,
             "RequestRejected": RequestRejected, "Result": Result, "card_names": card_names, "get_card": get_card,
             "ImageArtifact": ImageArtifact, "LatentArtifact": LatentArtifact, "Provenance": Provenance,
             "VideoArtifact": VideoArtifact, "PreviewEvent": PreviewEvent}  # fmt: skip
    assert set(fvgraph.__all__) == set(homes)
    assert all(getattr(fvgraph, name) is value for name, value in homes.items())
    assert set(fvgraph.__all__) <= set(dir(fvgraph))
    with pytest.raises(AttributeError, match="no attribute 'Engines'"):
        fvgraph.Engines  # noqa: B018
