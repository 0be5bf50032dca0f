"""Progress where the time goes: a compile announced with its label and elapsed seconds, plain lines
every few seconds without a terminal, the decode after the last step named."""

from __future__ import annotations

import io
import time

from rich.console import Console
from typer.testing import CliRunner

from fvgraph.cli import app
from fvgraph.cli.progress import RunProgress
from fvgraph.contract.progress import progress_span


def test_without_a_terminal_waits_are_plain_lines_and_a_line_comes_every_few_seconds():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=80)
    assert not console.is_terminal
    with RunProgress(console, "denoise", total=2, every=0.05) as progress:
        with progress_span("compiling", "denoise_cfg, batch bucket 2"):
            time.sleep(0.3)
        progress.advance()
        progress.advance()
        progress.wait("vae decode")
        time.sleep(0.15)
    lines = out.getvalue().splitlines()
    assert lines[0] == "compiling denoise_cfg, batch bucket 2 ..."
    ticks = [line for line in lines if line.startswith("compiling denoise_cfg, batch bucket 2 (")]
    assert ticks and all(" | denoise 0/2 | " in line for line in ticks)  # the wait, its seconds, the steps
    assert any(line.startswith("compiling denoise_cfg, batch bucket 2: done in ") for line in lines)
    assert "vae decode ..." in lines
    assert any(line.startswith("vae decode (") and "denoise 2/2" in line for line in lines)


def test_the_progress_logger_is_left_as_it_was():
    import logging

    logger = logging.getLogger("fvgraph.progress")
    before = (logger.level, logger.propagate, list(logger.handlers))
    with RunProgress(Console(file=io.StringIO()), "steps", 1):
        pass
    assert (logger.level, logger.propagate, list(logger.handlers)) == before


def test_a_compiled_generate_without_a_terminal_names_the_compile_and_the_decode(tmp_path):
    result = CliRunner().invoke(app, ["generate", "-O1", "--compile-backend", "eager", "--steps", "2", "--frames", "5",
                                      "-o", str(tmp_path / "v.gif")])  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "compiling denoise_cfg, batch bucket 1 ..." in lines
    assert any(line.startswith("compiling denoise_cfg, batch bucket 1: done in ") for line in lines)
    assert "vae decode ..." in lines
