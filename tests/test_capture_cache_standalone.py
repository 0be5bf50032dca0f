"""The capture cache's GPU default artifact, inductor's standalone artifact (run here on the CPU), under tampering: a changed byte,
a wrong fingerprint, an edited manifest. Each is refused with one log line naming the file, the step
is compiled again, and the tampered file is never handed to torch's loader."""

from __future__ import annotations

import hashlib
import json
import os
import logging
import shutil
from pathlib import Path

import pytest
import torch

from fvgraph.compile.capture_cache import file_sha256, verify
from fvgraph.compile.compiler import CompileConfig
from fvgraph.compile.graph_artifact import artifact_kind
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec

REQUEST = dict(prompt="a red fox", num_inference_steps=1, guidance_scale=4.0, height=16, width=16, num_frames=1,
               output_type="latent", seed=3)  # fmt: skip
LOGGERS = ("fvgraph.compile.compiler", "fvgraph.compile.capture_cache")


def engine(cache_dir) -> Engine:
    return Engine.from_card("tiny-wan", opt_level=1, device="cpu", cache_dir=cache_dir, buckets=BucketSpec(batch_sizes=(1,)),
                            compile_config=CompileConfig(backend="inductor", artifact_format="standalone"))  # fmt: skip


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("standalone") / "cache"
    [result] = engine(root).warmup([Request(**REQUEST)])
    assert result.ok and verify(root) == []
    return root


@pytest.fixture
def cache_copy(warm_cache, tmp_path) -> Path:
    shutil.copytree(warm_cache, tmp_path / "cache")
    return tmp_path / "cache"


class Loaded(list):
    """The files torch's standalone loader was handed, in order, with what each was when loaded: an
    artifact's name is its content hash, so a rebuild that reproduces the same bytes reuses the name
    (published as a new file: `os.replace` of a staged one)."""

    def inodes(self) -> set[int]:
        return {inode for _, inode, _ in self}

    def digests(self) -> set[str]:
        return {digest for _, _, digest in self}

    def __contains__(self, path) -> bool:
        return any(p == path for p, _, _ in self)


@pytest.fixture
def loaded(monkeypatch) -> Loaded:
    paths, load = Loaded(), torch._inductor.CompiledArtifact.load

    def recording(*, path, format="binary"):
        paths.append((Path(path), os.stat(path).st_ino, file_sha256(Path(path))))
        return load(path=path, format=format)

    monkeypatch.setattr(torch._inductor.CompiledArtifact, "load", staticmethod(recording))
    return paths


def manifest_of(root: Path) -> tuple[Path, dict]:
    [path] = root.glob("*/manifest.json")
    return path, json.loads(path.read_text())


def step_file(root: Path) -> Path:
    [path] = root.glob("*/*/*-step.bin")
    return path


def rebuilt_without_loading(root: Path, refused: Path, caplog, rejects: int = 1) -> list[str]:
    """Serve REQUEST from `root`: one compile, `refused` never loaded; the warning lines logged."""
    again = engine(root)
    with caplog.at_level(logging.WARNING), again.counters.expect(compiles=1, capture_cache_hits=0, capture_cache_stores=1,
                                                                 capture_cache_rejects=rejects):  # fmt: skip
        assert again.generate([Request(**REQUEST)])[0].ok
    assert verify(root) == []
    return [r.getMessage() for r in caplog.records if r.name in LOGGERS and r.levelno >= logging.WARNING]


def test_the_standalone_artifact_is_the_gpu_default_and_warms_a_fresh_engine(warm_cache, loaded):
    warm = engine(warm_cache)
    with warm.counters.expect(compiles=0, capture_cache_hits=1):
        assert warm.generate([Request(**REQUEST)])[0].ok
    assert step_file(warm_cache) in loaded
    assert CompileConfig().artifact_format == "auto"
    assert [artifact_kind("inductor", "auto", device) for device in ("cuda", "cpu")] == ["standalone", "inductor"]


def test_one_changed_byte_is_refused_naming_the_file(cache_copy, loaded, caplog):
    artifact = step_file(cache_copy)
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0x01
    artifact.write_bytes(bytes(data))
    [line] = rebuilt_without_loading(cache_copy, artifact, caplog)
    assert artifact.name in line and "sha256" in line
    assert hashlib.sha256(bytes(data)).hexdigest() not in loaded.digests()  # the changed bytes never loaded
    assert not artifact.exists() or artifact.read_bytes() != bytes(data)  # and gone


def test_an_artifact_of_another_torch_is_refused_by_its_loader_naming_the_file(cache_copy, loaded, caplog):
    """Its bytes re-hashed into the manifest, so only the torch key the artifact carries gives it away."""
    from torch._inductor.codecache import torch_key

    artifact, (path, manifest) = step_file(cache_copy), manifest_of(cache_copy)
    data, key = artifact.read_bytes(), torch_key()
    assert data.count(key) == 1
    artifact.write_bytes(data.replace(key, bytes(b ^ 0xFF for b in key)))
    [record] = manifest["entries"].values()
    record["artifacts"]["step"].update(sha256=file_sha256(artifact), bytes=artifact.stat().st_size)
    path.write_text(json.dumps(manifest))
    [line] = rebuilt_without_loading(cache_copy, artifact, caplog)
    assert str(artifact) in line and "failed to load" in line


def test_a_manifest_recording_another_fingerprint_is_not_used(cache_copy, loaded, caplog):
    path, manifest = manifest_of(cache_copy)
    manifest["fingerprint"]["torch"] = "2.0.0-other"
    path.write_text(json.dumps(manifest))
    artifact = step_file(cache_copy)
    refused = artifact.stat().st_ino
    [line] = rebuilt_without_loading(cache_copy, artifact, caplog, rejects=0)
    assert str(path) in line and "torch: 2.0.0-other" in line
    assert refused not in loaded.inodes()  # only the rebuilt files were loaded
    assert manifest_of(cache_copy)[1]["fingerprint"]["torch"] == torch.__version__


@pytest.mark.parametrize("edit", ["meta", "sha256"])
def test_an_edited_manifest_is_refused_naming_the_file(cache_copy, loaded, caplog, edit):
    path, manifest = manifest_of(cache_copy)
    [record] = manifest["entries"].values()
    if edit == "meta":
        record["meta"]["output_names"] = list(reversed(record["meta"]["output_names"]))
    else:
        record["artifacts"]["step"]["sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))
    artifact = step_file(cache_copy)
    refused = artifact.stat().st_ino
    [line] = rebuilt_without_loading(cache_copy, artifact, caplog)
    assert str(path) in line and ("meta_sha256" if edit == "meta" else "sha256") in line
    assert refused not in loaded.inodes()  # only the rebuilt files were loaded
