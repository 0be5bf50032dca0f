"""The capture cache under tampering and faults: wrong-shaped manifests, entries that hash but do not
load, an unwritable root, a lock held by another process, orphaned staging files."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fvgraph.runtime.buckets import BucketSpec
from fvgraph.compile.capture_cache import CaptureCache, clear, file_sha256, meta_digest, verify
from fvgraph.cli import app
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.request import Request

REQUEST = dict(prompt="a red fox", num_inference_steps=1, guidance_scale=4.0, height=16, width=16, num_frames=1,
               output_type="latent", seed=3)  # fmt: skip
FINGERPRINT = dict(card_id="tiny-wan", weights_version="w1", opt_level=1, backend="aot_eager")
FACTORS = dict(step_kind="denoise_cfg", batch=1, shape=dict(inputs=[["latents", [16, 1, 2, 2], "float32"]]))


def engine(cache_dir) -> Engine:
    return Engine.from_card("tiny-wan", opt_level=1, device="cpu", cache_dir=cache_dir,
                            compile_config=CompileConfig(backend="aot_eager"), buckets=BucketSpec(batch_sizes=(1,)))  # fmt: skip


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("warm") / "cache"
    [result] = engine(root).warmup([Request(**REQUEST)])
    assert result.ok and verify(root) == []
    return root


@pytest.fixture
def cache_copy(warm_cache, tmp_path) -> Path:
    shutil.copytree(warm_cache, tmp_path / "cache")
    return tmp_path / "cache"


def manifest_of(root: Path) -> tuple[Path, dict]:
    [path] = root.glob("*/manifest.json")
    return path, json.loads(path.read_text())


def published(root) -> CaptureCache:
    cache = CaptureCache(root, FINGERPRINT)
    with cache.staging_dir() as staging:
        (Path(staging) / "step.pt2").write_bytes(os.urandom(1024))
        cache.publish("k1", FACTORS, {"step": Path(staging) / "step.pt2"}, meta={"param_names": []})
    return cache


WRONG_SHAPES = {
    "a list": lambda m: [m],
    "entries null": lambda m: {**m, "entries": None},
    "an entry that is a string": lambda m: {**m, "entries": {"k1": "a string"}},
    "an entry without factors": lambda m: {**m, "entries": {"k1": {k: v for k, v in m["entries"]["k1"].items() if k != "factors"}}},
    "a fingerprint that is a number": lambda m: {**m, "fingerprint": 7},
}


@pytest.mark.parametrize("shape", sorted(WRONG_SHAPES))
def test_a_manifest_of_the_wrong_shape_is_reported_and_rebuilt_not_a_crash(tmp_path, shape, caplog):
    cache = published(tmp_path)
    path, manifest = manifest_of(tmp_path)
    path.write_text(json.dumps(WRONG_SHAPES[shape](manifest)))
    with caplog.at_level(logging.WARNING, "fvgraph.compile.capture_cache"):
        assert cache.find("k1") is None
    assert "manifest" in caplog.text
    problems = verify(tmp_path)
    assert any("manifest" in p for p in problems)  # and its artifacts, now left over
    listing = CliRunner().invoke(app, ["cache", "ls", "--cache-dir", str(tmp_path)])
    assert listing.exit_code == 0, listing.output
    checked = CliRunner().invoke(app, ["cache", "verify", "--cache-dir", str(tmp_path)])
    assert checked.exit_code == 1 and "manifest" in checked.output
    published(tmp_path)  # the next writer rebuilds it
    assert cache.find("k1") is not None and verify(tmp_path, load=False) == []  # random bytes: hashed, not loaded


def test_an_entry_that_hashes_but_does_not_load_is_found_by_verify_and_replaced(cache_copy):
    path, manifest = manifest_of(cache_copy)
    [(key, record)] = manifest["entries"].items()
    artifact = path.parent / record["artifacts"]["step"]["file"]
    artifact.write_bytes(b"built against a library that changed" * 100)
    record["artifacts"]["step"].update(sha256=file_sha256(artifact), bytes=artifact.stat().st_size)
    path.write_text(json.dumps(manifest))
    [problem] = verify(cache_copy)
    assert key in problem and "does not load" in problem

    again = engine(cache_copy)
    with again.counters.expect(compiles=1, capture_cache_rejects=1, capture_cache_hits=0, capture_cache_stores=1):
        assert again.generate([Request(**REQUEST)])[0].ok
    assert manifest_of(cache_copy)[1]["entries"][key]["artifacts"]["step"]["sha256"] != record["artifacts"]["step"]["sha256"]
    assert verify(cache_copy) == []


def test_a_frozen_engine_says_its_entry_was_rejected_not_that_the_signature_is_new(cache_copy):
    [artifact] = cache_copy.glob("*/*/*-step.pt2")
    artifact.write_bytes(artifact.read_bytes()[:-10])
    frozen = engine(cache_copy)
    frozen.freeze()
    [result] = frozen.generate([Request(**REQUEST)])
    assert result.status == "failed" and "rejected" in result.error and "truncated" in result.error
    assert "new signature" not in result.error


def test_warmup_into_a_root_it_cannot_write_fails(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    args = ["warmup", "--cache-dir", str(tmp_path / "a-file" / "cache"), "--compile-backend", "aot_eager", "-O", "1",
            "--buckets", "1", "--shape", "1x16x16", "--device", "cpu"]  # fmt: skip
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 2 and "cannot write" in done.output, done.output


def test_warmup_that_stores_nothing_fails_naming_what_was_not_stored(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr("fvgraph.compile.compiler.save_graph", refuse)  # the step is then compiled in process, unstored
    args = ["warmup", "--cache-dir", str(tmp_path / "cache"), "--compile-backend", "eager", "-O", "1",
            "--buckets", "1", "--shape", "1x16x16", "--device", "cpu", "--guidance", "4"]  # fmt: skip
    done = CliRunner(env={"COLUMNS": "200"}).invoke(app, args)
    assert done.exit_code == 1 and "not stored" in done.output, done.output


def _hold_lock(directory: Path):
    directory.mkdir(parents=True, exist_ok=True)
    holder = open(directory / ".lock", "a+")  # noqa: SIM115
    fcntl.flock(holder, fcntl.LOCK_EX)
    return holder


def test_a_held_lock_times_out_with_a_log_line_naming_the_lock(tmp_path, caplog):
    cache = published(tmp_path / "cache")
    holder = _hold_lock(cache.dir)
    cache.lock_timeout_s, cache.lock_notice_s = 1.0, 0.2
    outcome = []

    def publish():
        try:
            with cache.staging_dir() as staging:
                (Path(staging) / "step.pt2").write_bytes(os.urandom(64))
                cache.publish("k2", FACTORS, {"step": Path(staging) / "step.pt2"}, meta={})
            outcome.append("published")
        except TimeoutError as err:
            outcome.append(str(err))

    with caplog.at_level(logging.WARNING, "fvgraph.compile.capture_cache"):
        worker = threading.Thread(target=publish, daemon=True)
        worker.start()
        worker.join(timeout=30)
    holder.close()
    assert not worker.is_alive(), "blocked on the lock with no timeout"
    assert ".lock" in outcome[0] and "waiting" in caplog.text and str(cache.dir) in caplog.text


def test_generate_serves_when_another_process_holds_the_lock(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("fvgraph.compile.capture_cache.LOCK_TIMEOUT_S", 1.0)
    # What is staged does not matter: publishing never gets the lock. Skipping the export saves seconds.
    monkeypatch.setattr("fvgraph.compile.compiler.save_graph", lambda gm, args, backend, path, patches: path.write_bytes(b"x"))
    served = engine(tmp_path / "cache")
    holder = _hold_lock(served.compiler.capture_cache.dir)
    results = []
    with caplog.at_level(logging.WARNING):
        worker = threading.Thread(target=lambda: results.extend(served.generate([Request(**REQUEST)])), daemon=True)
        worker.start()
        worker.join(timeout=120)
    holder.close()
    assert not worker.is_alive() and results[0].ok
    assert "lock" in caplog.text and "compiling it in process" in caplog.text


def test_orphaned_staging_files_are_reported_listed_and_cleared(cache_copy):
    [fingerprint_dir] = [p for p in cache_copy.iterdir() if p.is_dir()]
    stale = fingerprint_dir / ".staging-999999999-abc"  # a pid that is not running
    stale.mkdir()
    (stale / "step.pt2").write_bytes(os.urandom(2048))
    [entry_dir] = [p for p in fingerprint_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    (entry_dir / "0000-step.pt2").write_bytes(b"left by a replaced entry")
    orphan_root = cache_copy / "0123456789abcdef0123"  # a warmup killed before its first publish: no manifest
    (orphan_root / ".staging-999999999-def").mkdir(parents=True)
    (orphan_root / ".staging-999999999-def" / "step.pt2").write_bytes(os.urandom(4096))

    problems = "\n".join(verify(cache_copy))
    assert ".staging-999999999-abc" in problems and "0000-step.pt2" in problems and orphan_root.name in problems
    listing = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["cache", "ls", "--cache-dir", str(cache_copy)])
    assert orphan_root.name in listing.output and "orphan" in listing.output
    assert clear(cache_copy) == 2 and list(cache_copy.iterdir()) == []


def test_entries_whose_manifest_was_deleted_are_reported_as_left_over(cache_copy):
    [fingerprint_dir] = [p for p in cache_copy.iterdir() if p.is_dir()]
    (fingerprint_dir / "manifest.json").unlink()
    (fingerprint_dir / ".lock").unlink(missing_ok=True)
    [problem] = verify(cache_copy)
    assert fingerprint_dir.name in problem and "left over" in problem
    assert clear(cache_copy) == 1


def test_a_live_warmups_staging_is_not_an_orphan(cache_copy):
    [fingerprint_dir] = [p for p in cache_copy.iterdir() if p.is_dir()]
    (fingerprint_dir / f".staging-{os.getpid()}-xyz").mkdir()
    assert verify(cache_copy) == []


def test_warmup_refuses_a_shape_the_card_does_not_allow_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr("fvgraph.engine.engine.Engine.from_card", lambda *a, **k: pytest.fail("the engine was built"))
    args = ["warmup", "--cache-dir", str(tmp_path), "--compile-backend", "aot_eager", "-O", "1", "--shape", "5x512x512"]
    done = CliRunner(env={"COLUMNS": "200"}).invoke(app, args)
    assert done.exit_code == 2 and "height: 512 exceeds" in done.output, done.output


@pytest.mark.parametrize(("field", "edit"), [
    ("output_names", lambda names: [name.replace("latents", "x") for name in names]),
    ("input_names", lambda names: list(reversed(names))),
    ("hoisted_like", lambda like: like[:-1]),
])  # fmt: skip
def test_an_entry_whose_metadata_was_edited_is_reported_and_rebuilt(cache_copy, field, edit):
    path, manifest = manifest_of(cache_copy)
    [(key, record)] = manifest["entries"].items()
    assert record["meta"][field], f"the warm entry has no {field} to edit"
    record["meta"][field] = edit(record["meta"][field])
    path.write_text(json.dumps(manifest))
    [problem] = verify(cache_copy, load=False)
    assert key in problem and "metadata" in problem

    again = engine(cache_copy)
    with again.counters.expect(compiles=1, capture_cache_rejects=1, capture_cache_hits=0, capture_cache_stores=1):
        assert again.generate([Request(**REQUEST)])[0].ok
    assert verify(cache_copy) == []


def test_an_entry_whose_inputs_differ_from_the_step_is_rebuilt(cache_copy):
    """Metadata hashed right but not fitting the step (a manifest rewritten as a whole) is not used either."""
    path, manifest = manifest_of(cache_copy)
    [(key, record)] = manifest["entries"].items()
    record["meta"]["input_names"] = ["not_an_input", *record["meta"]["input_names"][1:]]
    record["meta_sha256"] = meta_digest(record["meta"])
    path.write_text(json.dumps(manifest))
    again = engine(cache_copy)
    with again.counters.expect(compiles=1, capture_cache_rejects=1, capture_cache_hits=0):
        assert again.generate([Request(**REQUEST)])[0].ok


def test_symbolic_links_in_the_cache_are_never_followed(cache_copy, tmp_path):
    [fingerprint_dir] = [p for p in cache_copy.iterdir() if p.is_dir()]
    elsewhere = tmp_path / "elsewhere"  # someone else's files, shaped like a fingerprint directory
    (elsewhere / "entry").mkdir(parents=True)
    (elsewhere / "entry" / "precious.bin").write_bytes(b"not the cache's")
    (elsewhere / ".lock").write_text("")
    (cache_copy / "fedcba9876543210fedc").symlink_to(elsewhere, target_is_directory=True)
    (fingerprint_dir / "linked-entry").symlink_to(elsewhere / "entry", target_is_directory=True)

    problems = "\n".join(verify(cache_copy))
    assert "fedcba9876543210fedc is a symbolic link" in problems and "not followed" in problems
    assert "linked-entry" in problems and "precious.bin" not in problems
    runner = CliRunner(env={"COLUMNS": "200"})
    listing = runner.invoke(app, ["cache", "ls", "--cache-dir", str(cache_copy)])
    assert listing.exit_code == 0 and "skipped fedcba9876543210fedc" in listing.output, listing.output
    done = runner.invoke(app, ["cache", "clear", "--yes", "--cache-dir", str(cache_copy)])
    assert done.exit_code == 0 and "skipped fedcba9876543210fedc is a symbolic link" in " ".join(done.output.split()), done.output
    assert (elsewhere / "entry" / "precious.bin").read_bytes() == b"not the cache's" and (elsewhere / ".lock").exists()
    assert not fingerprint_dir.exists() and (cache_copy / "fedcba9876543210fedc").is_symlink()
