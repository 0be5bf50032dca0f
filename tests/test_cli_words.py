"""The command line as a newcomer meets it: errors in the flags' own words, before any work; one note
when random weights or CPU-less CUDA graphs would mislead; one -O default; help readable at 80 columns."""

from __future__ import annotations

import click
import pytest
import typer
from PIL import Image
from typer.testing import CliRunner

from fvgraph.cli import app
from fvgraph.cli.options import DEFAULT_OPT_LEVEL

runner = CliRunner(env={"COLUMNS": "80"})


@pytest.fixture
def no_engine(monkeypatch):
    monkeypatch.setattr("fvgraph.engine.engine.Engine.from_card", lambda *a, **k: pytest.fail("the engine was built"))


@pytest.mark.parametrize(("args", "line"), [
    (["--steps", "0"], "error: --steps: must be >= 1"),
    (["--guidance", "-1"], "error: --guidance: must be >= 0"),
    (["--height", "0"], "error: --height: must be > 0"),
    (["-o", "x.png"], "error: --output x.png: card tiny-wan makes 9-frame videos"),
    (["tiny-wna"], "error: unknown card 'tiny-wna'; did you mean 'tiny-wan'"),
    (["--card", "flux-dev"], "error: unknown card 'flux-dev'; did you mean 'flux.1-dev'"),
    (["--image", "no-such.png"], "error: --image no-such.png: not a readable PNG, JPEG or WebP image"),
    (["--video", "no-such.mp4"], "error: --video no-such.mp4: not a decodable video"),
])  # fmt: skip
def test_generate_errors_are_one_line_naming_the_flag_before_any_work(tmp_path, no_engine, args, line):
    result = runner.invoke(app, ["generate", *args] + ([] if "-o" in args else ["-o", str(tmp_path / "v.gif")]))
    assert result.exit_code == 2
    [printed] = result.output.strip().splitlines()
    assert printed.startswith(line), printed
    assert "pydantic" not in printed and "num_inference_steps" not in printed


def test_a_field_rule_from_the_card_is_said_with_the_flag(tmp_path):
    result = runner.invoke(app, ["generate", "-O0", "--frames", "6", "-o", str(tmp_path / "v.gif")])
    assert result.exit_code == 2 and "--frames=6 must be 4k+1" in result.output, result.output


def test_an_embedded_card_says_once_that_its_weights_are_random_and_names_a_real_model(tmp_path):
    result = runner.invoke(app, ["generate", "-O0", "--steps", "1", "--frames", "1", "-o", str(tmp_path / "v.gif")])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert text.count("random (seeded) weights") == 1
    assert "fvgraph generate Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in text


def test_o2_on_a_cpu_says_once_that_cuda_graphs_need_a_gpu(tmp_path):
    result = runner.invoke(app, ["generate", "-O2", "--compile-backend", "eager", "--device", "cpu", "--steps", "1",
                                 "--frames", "1", "-o", str(tmp_path / "v.gif")])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert " ".join(result.output.split()).count("CUDA graphs apply only on a GPU") == 1


def test_every_command_with_an_opt_level_shares_one_default():
    command = typer.main.get_command(app)
    defaults = {}
    for name in ("generate", "serve", "serve-ray", "parity", "warmup"):
        [option] = [p for p in command.commands[name].params if p.name == "opt_level"]
        defaults[name] = option.default
    assert set(defaults.values()) == {DEFAULT_OPT_LEVEL} == {1}, defaults


def _commands(group: click.Group, prefix=()):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, (*prefix, name))
        else:
            yield (*prefix, name), command


@pytest.mark.parametrize("path", [path for path, _ in _commands(typer.main.get_command(app))], ids=" ".join)
def test_help_at_80_columns_shows_every_option_whole(path):
    command = dict(_commands(typer.main.get_command(app)))[path]
    result = runner.invoke(app, [*path, "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    for param in command.params:
        for flag in (*param.opts, *param.secondary_opts):
            if flag.startswith("-"):
                assert any(flag in line.split() or f"{flag}," in line or line.strip().startswith(flag) for line in lines), flag


def test_parity_at_o2_on_a_cpu_says_once_that_cuda_graphs_need_a_gpu(monkeypatch):
    def stop(*args, **kwargs):
        raise RuntimeError("stopped before comparing")

    monkeypatch.setattr("fvgraph.parity.compare", stop)
    result = runner.invoke(app, ["parity", "-O2", "--against", "3", "--device", "cpu"])
    assert result.exit_code == 2 and "stopped before comparing" in result.output
    assert " ".join(result.output.split()).count("CUDA graphs apply only on a GPU") == 2  # -O2's and -O3's: one line each


@pytest.mark.parametrize(("args", "line"), [
    (["--image", "IMAGE"], "error: --image: card 'tiny-wan' runs loop 't2v', which takes no image; leave it unset"),
    (["--strength", "0.5"], "error: --strength: sets how far a video-to-video request goes from its video: give the video with it"),
])  # fmt: skip
def test_an_input_the_card_does_not_take_is_said_with_its_flag(tmp_path, args, line):
    Image.new("RGB", (16, 16)).save(tmp_path / "image.png")
    args = [str(tmp_path / "image.png") if a == "IMAGE" else a for a in args]
    result = runner.invoke(app, ["generate", "-O0", *args, "-o", str(tmp_path / "v.gif")])
    assert result.exit_code == 2
    [printed] = result.output.strip().splitlines()
    assert printed == line, printed
