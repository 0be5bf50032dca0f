"""Hardening, round three, away from HTTP: adapters whose numbers poison every request, adapter metadata
and files that escaped as 500s or were read whole, tampered behaviour records, weights that overflow
only once cast, a parity plot path checked at the end, unbounded adapter names, merge scales of NaN.
Each test failed on the code before its fix."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import fvgraph
from fvgraph.adapters.lora_file import AdapterError
from fvgraph.adapters.slots import LoraSlots
from fvgraph.behavior import BehaviorRecord, RolloutSampling
from fvgraph.cli import app
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
from lora_files import peft_lora

SMALL = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2}
SLOTS = LoraSlots(max_loras=2, max_lora_rank=8, max_loras_per_request=2)


@pytest.fixture(scope="module")
def good_lora(tmp_path_factory) -> Path:
    return peft_lora(tmp_path_factory.mktemp("good"), 1, ["to_q", "to_k"], rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def engine():
    return Engine.from_card("tiny-wan", device="cpu", lora_slots=SLOTS)


def _rewritten(source: Path, target: Path, config: dict | None = None, scale_factors: float | None = None) -> Path:
    """`source` with its LoraConfig metadata updated by `config` and/or its factors multiplied."""
    tensors = load_file(str(source))
    with safe_open(str(source), framework="pt") as handle:
        metadata = dict(handle.metadata())
    if config is not None:
        lora_config = json.loads(metadata["lora_adapter_metadata"])
        for key, value in config.items():
            if value is ...:
                lora_config.pop(f"transformer.{key}", None)
            else:
                lora_config[f"transformer.{key}"] = value
        metadata["lora_adapter_metadata"] = json.dumps(lora_config)
    if scale_factors is not None:
        tensors = {k: v * scale_factors for k, v in tensors.items()}
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target), metadata=metadata)
    return target


def _latents(engine: Engine, **extra) -> torch.Tensor:
    [result] = engine.generate([Request(prompt="a fox", seed=3, output_type="latent", **SMALL, **extra)])
    assert result.ok, result.error
    return result.latents


# -- fault 1: a scaling that is not finite ---------------------------------------------------------


@pytest.mark.parametrize("change, words", [
    ({"config": {"lora_alpha": float("nan")}}, "is not a finite float32"),
    ({"scale_factors": 1e20}, "past float32's range"),  # finite factors whose product overflows
])  # fmt: skip
def test_an_adapter_whose_scaling_or_product_is_not_finite_is_refused_at_load(engine, good_lora, tmp_path, change, words):
    bad = _rewritten(good_lora, tmp_path / "bad.safetensors", **change)
    with pytest.raises(AdapterError, match=words):
        engine.load_lora("bad", bad)
    assert engine.loras() == []


def test_rows_that_chose_no_adapter_read_nothing_of_slot_0(engine, good_lora):
    """A row's unused places point at slot 0: whatever it holds (here NaN everywhere, written past the
    load checks) must not reach them, and a row that chose an adapter in another slot still gets it exactly."""
    alone = _latents(engine)
    engine.load_lora("good", good_lora)  # slot 0
    with_adapter = _latents(engine, loras={"good": 1.0})
    engine.unload_lora("good")
    store = engine._adapter_admin._adapters.store
    try:
        for t in store.targets.values():
            for buffer in (t.down, t.up, t.bias, t.scaling):
                buffer[0] = math.nan
        store.digests[0] = "poison"  # held: the next load takes slot 1
        assert torch.equal(_latents(engine), alone)
        engine.load_lora("good", good_lora)
        assert torch.equal(_latents(engine, loras={"good": 1.0}), with_adapter)
    finally:
        store.clear(0)
        if engine.loras():
            engine.unload_lora("good")


# -- fault 2: bad metadata -------------------------------------------------------------------------


@pytest.mark.parametrize("config, words", [
    ({"r": 0}, "r=0 give no scaling"), ({"no_such_key": 1}, "LoraConfig"), ({"lora_alpha": "strong"}, "lora_alpha"),
    ({"lora_alpha": 1e40}, "not a finite float32"),
])  # fmt: skip
def test_bad_adapter_metadata_is_an_adapter_error_naming_the_file(engine, good_lora, tmp_path, config, words):
    bad = _rewritten(good_lora, tmp_path / "meta.safetensors", config=config)
    with pytest.raises(AdapterError, match=words) as err:
        engine.load_lora("bad", bad)
    assert str(bad) in str(err.value)


def test_rank_zero_factors_are_refused(engine, tmp_path):
    state = {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(0, 32),
             "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(32, 0)}  # fmt: skip
    save_file(state, str(tmp_path / "r0.safetensors"))
    with pytest.raises(AdapterError, match="rank"):
        engine.load_lora("r0", tmp_path / "r0.safetensors")


def test_the_cli_names_the_adapter_file_in_one_line(good_lora, tmp_path):
    bad = _rewritten(good_lora, tmp_path / "cli.safetensors", config={"r": 0})
    done = CliRunner().invoke(app, ["generate", "tiny-wan", "-p", "a", "--steps", "1", "--frames", "1", "-O0",
                                    "--lora", f"x={bad}", "-o", str(tmp_path / "x.png")])  # fmt: skip
    assert done.exit_code == 2 and str(bad.name) in done.output and "Traceback" not in done.output, done.output


# -- fault 3 and 10: files that are no adapter, paths too long -------------------------------------


def test_files_that_are_not_safetensors_are_refused_unread(engine, tmp_path, monkeypatch):
    import diffusers

    def never(*args, **kwargs):
        raise AssertionError("diffusers read a file that is not a safetensors adapter")

    monkeypatch.setattr(diffusers.WanPipeline, "lora_state_dict", never)
    big = tmp_path / "big.safetensors"
    with big.open("wb") as file:  # 1 GiB, sparse: a header length no safetensors file has
        file.truncate(1 << 30)
    pickle = tmp_path / "weights.pt"
    torch.save({"a": torch.zeros(2)}, pickle)
    text = tmp_path / "pointer.safetensors"
    text.write_text("version https://git-lfs.github.com/spec/v1\n")
    for path, words in ((big, "not a safetensors file"), (pickle, ".safetensors files only"), (text, "not a safetensors file"),
                        (tmp_path / ("x" * 300 + ".safetensors"), "cannot be opened"),
                        (Path("/" + "d/" * 2000 + "a.safetensors"), "4014 characters")):  # fmt: skip
        with pytest.raises(AdapterError, match=words) as err:
            engine.load_lora("x", path)
        assert len(str(err.value)) < 1000


# -- fault 6: tampered behaviour records ----------------------------------------------------------


def _record(tmp_path) -> Path:
    engine = Engine.from_card("tiny-wan", device="cpu")
    [result] = engine.generate([Request(prompt="a fox", seed=1, rollout=RolloutSampling(noise_level=0.7), **SMALL)])
    return result.record.save(tmp_path / "record.safetensors")


@pytest.mark.parametrize("tamper, words", [
    (lambda values, tensors: values.update(seed="abc"), "seed='abc' must be int"),
    (lambda values, tensors: values.update(extra=1), "unknown fields extra"),
    (lambda values, tensors: values.pop("request_id"), "lacks request_id"),
    (lambda values, tensors: values.update(noise_level=float("nan")), "noise_level=nan must be finite"),
    (lambda values, tensors: tensors.pop("latents"), "no 'latents' tensor"),
    (lambda values, tensors: tensors.pop("log_probs"), "no 'log_probs' tensor"),
    (lambda values, tensors: tensors.update(log_probs=torch.zeros(7)), "'log_probs' has shape"),
])  # fmt: skip
def test_a_tampered_behavior_record_is_refused_naming_the_file_and_field(tmp_path, tamper, words):
    path = _record(tmp_path)
    assert BehaviorRecord.load(path).num_steps == SMALL["num_inference_steps"]
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as handle:
        values = json.loads(handle.metadata()["fvgraph.behavior_record"])
    tamper(values, tensors)
    bad = tmp_path / "tampered.safetensors"
    save_file(tensors, str(bad), metadata={"fvgraph.behavior_record": json.dumps(values)})
    with pytest.raises(ValueError, match=words) as err:
        BehaviorRecord.load(bad)
    assert str(bad) in str(err.value)


# -- fault 7: weights finite only before the cast -------------------------------------------------


def test_update_weights_checks_after_the_cast_and_refuses_complex():
    engine = Engine.from_card("tiny-wan", device="cpu")
    name, param = next(iter(engine.loop.components.transformer.named_parameters()))
    version = engine.loop.components.weights_version
    for value, words in ((torch.full(param.shape, 1e300, dtype=torch.float64), "NaN or Inf values as torch.float32"),
                         (torch.zeros(param.shape, dtype=torch.complex64), "complex64")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            engine.update_weights({name: value}, version="v-bad")
    assert engine.loop.components.weights_version == version
    assert torch.isfinite(param).all()


# -- fault 8: parity's plot path -------------------------------------------------------------------


@pytest.mark.parametrize("plot, words", [("heat.bmp2", "--plot"), ("a-file/heat.png", "--plot")])
def test_parity_checks_its_plot_path_before_comparing(tmp_path, plot, words):
    (tmp_path / "a-file").write_text("not a folder")
    done = CliRunner().invoke(app, ["parity", "--card", "tiny-wan", "-O0", "--against", "0", "--plot", str(tmp_path / plot)])
    assert done.exit_code == 2 and words in done.output and "Traceback" not in done.output, done.output


# -- fault 11 and 12: adapter names and merge scales -----------------------------------------------


def test_a_requests_adapter_names_follow_the_load_rule_and_are_quoted_short():
    for name in ("x" * 2_000_000, "", "../etc", "a b"):
        with pytest.raises(ValueError) as err:
            Request(prompt="a", loras={name: 1.0})
        assert "must be 1-64 characters" in str(err.value) and len(str(err.value)) < 8192


@pytest.mark.parametrize("scale", ["nan", "inf", "-inf", "101"])
def test_merge_scales_must_be_finite_and_bounded(good_lora, tmp_path, scale):
    done = CliRunner().invoke(app, ["generate", "tiny-wan", "-p", "a", "--steps", "1", "--frames", "1", "-O0", "--lora",
                                    f"m={good_lora}", "--merge-lora", f"m={scale}", "-o", str(tmp_path / "x.png")])  # fmt: skip
    assert done.exit_code == 2 and "--merge-lora" in done.output and "finite number in [-100, 100]" in done.output, done.output
    with pytest.raises(AdapterError, match=r"merge_loras\['m'\]"):
        fvgraph.Engine.from_card("tiny-wan", device="cpu", loras={"m": good_lora}, merge_loras={"m": float(scale)})
