"""`fvgraph serve-ray` and ReplicaSpec refuse bad options before Ray starts, naming the option and the rule."""

import importlib
import socket
import sys
import types

import pytest
from typer.testing import CliRunner

from fvgraph.cli import app

SERVE_RAY = importlib.import_module("fvgraph.cli.serve_ray")  # the module: fvgraph.cli.serve_ray names the command

runner = CliRunner()


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "--replicas=0 must be at least 1"),
    (["--replicas", "2", "--autoscaling", '{"max_replicas": 4}'], "--replicas and --autoscaling: give one"),
    (["--autoscaling", "[1, 2]"], "--autoscaling='[1, 2]' must be a JSON object"),
    (["--autoscaling", "{max"], "must be a JSON object (Ray Serve's autoscaling_config)"),
    (["--memory-budget", "lots"], "--memory-budget='lots' must be a size"),
    (["--memory-budget", "inf"], "--memory-budget='inf' must be a finite size"),
    (["--max-body-bytes", "0"], "--max-body-bytes=0 must be at least 1"),
    (["--warmup-shape", "9x64"], "--warmup-shape='9x64' must be FRAMESxHEIGHTxWIDTH"),
    (["-O", "7"], "opt_level=7 must be 0, 1, 2 or 3"),
    (["--ray-cpus", "0"], "--ray-cpus=0 must be at least 1"),
    (["--cache-methods", "tea"], "--cache-methods='tea': cache_methods: 'tea' is not a step-caching method"),
    (["--allowed-origins", "app.example"], "--allowed-origins 'app.example' must be '*' or an origin"),
    (["--served-model-name", "two words"], "--served-model-name='two words' must be 1 to 256 printable characters"),
])  # fmt: skip
def test_bad_options_exit_2_naming_the_option(tmp_path, args, message):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    result = runner.invoke(app, ["serve-ray", "--storage-dir", str(tmp_path), *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_without_ray_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where the extra is missing
    monkeypatch.delitem(sys.modules, "fvgraph.serving.ray_deployment", raising=False)
    result = runner.invoke(app, ["serve-ray", "--storage-dir", str(tmp_path)])
    assert result.exit_code == 2 and "pip install 'fvgraph[ray]'" in " ".join(result.output.split()), result.output


def test_a_port_in_use_exits_2_before_ray_starts(tmp_path, monkeypatch):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    monkeypatch.setattr(SERVE_RAY, "_run", lambda *args: pytest.fail("Ray started on a port in use"))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = runner.invoke(app, ["serve-ray", "--storage-dir", str(tmp_path), "--port", str(port)])
    assert result.exit_code == 2, result.output
    assert f"--port={port}: cannot bind 127.0.0.1:{port}: Address already in use" in " ".join(result.output.split())


def _built_spec(monkeypatch, tmp_path, args: list[str]) -> dict:
    """What `fvgraph serve-ray ARGS` gives ReplicaSpec, with Ray out of the way: a stand-in for
    fvgraph.serving.ray_deployment records the spec's fields, and nothing is run."""
    built = {}
    stand_in = types.ModuleType("fvgraph.serving.ray_deployment")
    stand_in.ReplicaSpec = lambda **fields: built.update(fields) or fields
    stand_in.build_app = lambda spec, **options: spec
    monkeypatch.setitem(sys.modules, "fvgraph.serving.ray_deployment", stand_in)
    monkeypatch.setattr(SERVE_RAY, "_run", lambda app, *rest: None)
    result = runner.invoke(app, ["serve-ray", "--storage-dir", str(tmp_path), *args])
    assert result.exit_code == 0, result.output
    return built


def test_served_names_origins_and_playground_reach_the_replicas_http_settings(tmp_path, monkeypatch):
    checkpoint = tmp_path / "models--Wan-AI--Wan2.1-T2V-1.3B-Diffusers" / "snapshots" / "abc"
    checkpoint.mkdir(parents=True)
    settings = _built_spec(monkeypatch, tmp_path, [
        "--checkpoint", str(checkpoint), "--served-model-name", "sora-2", "--served-model-name", "wan",
        "--allowed-origins", "http://app.example", "--allowed-origins", "*", "--no-playground"])["settings"]  # fmt: skip
    assert settings.model_names.listed == ["tiny-wan", "sora-2", "wan", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"]
    assert settings.allowed_origins == ("http://app.example", "*") and settings.playground is False

    defaults = _built_spec(monkeypatch, tmp_path, [])["settings"]  # as `fvgraph serve --port` without them
    assert defaults.model_names.listed == ["tiny-wan"] and defaults.allowed_origins == () and defaults.playground is True


def test_a_hub_repo_id_reaches_the_replicas_as_given_and_a_folder_as_an_absolute_path(tmp_path, monkeypatch):
    repo = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    built = _built_spec(monkeypatch, tmp_path, ["--card", "wan2.1-t2v-1.3b", "--checkpoint", repo])
    assert built["checkpoint"] == repo and built["settings"].model_names.listed == ["wan2.1-t2v-1.3b", repo]
    folder = tmp_path / "weights"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    assert _built_spec(monkeypatch, tmp_path, ["--checkpoint", "weights"])["checkpoint"] == str(folder.resolve())


def test_replica_spec_names_the_field_and_the_rule(tmp_path):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from fvgraph.serving.ray_deployment import ReplicaSpec, build_app

    with pytest.raises(ValueError, match="engine_kwargs repeats \\['opt_level'\\]"):
        ReplicaSpec(storage_dir=str(tmp_path), engine_kwargs={"opt_level": 2})
    with pytest.raises(ValueError, match="storage_dir must name a directory"):
        ReplicaSpec(storage_dir=" ")
    with pytest.raises(ValueError, match="give num_replicas or autoscaling_config, not both"):
        build_app(ReplicaSpec(storage_dir=str(tmp_path)), num_replicas=2, autoscaling_config={"max_replicas": 2})
