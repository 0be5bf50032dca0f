"""The capture cache: a warm process compiles nothing, and no stale, foreign or corrupted entry is ever run."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fvgraph.runtime.buckets import BucketSpec
from fvgraph.cli import app
from fvgraph.compile.capture_cache import CacheEntry, CaptureCache, verify
from fvgraph.compile.compiler import CompileConfig, RecompileError
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
from fvgraph.compile.signature import RuntimeFactors

REQUEST = dict(prompt="a red fox", num_inference_steps=2, guidance_scale=4.0, height=32, width=32, num_frames=5, seed=3)
SHAPE = "5x32x32"

# A process that serves REQUEST from a capture cache and reports its counters and latents. With
# "forbid", inductor's compilers raise in it, and with "forbid_gxx" g++ and inductor's CPU ISA probe
# too: a warm start needs none of them (but a standalone artifact's first load on a CPU builds its C++
# kernels with g++, see graph_artifact).
SERVE = """
import json, sys, torch
if sys.argv[5].startswith("forbid"):
    import torch._inductor.compile_fx, torch._inductor.cpp_builder, torch._inductor.cpu_vec_isa
    def forbidden(*args, **kwargs):
        raise AssertionError("a warm start ran an inductor compile, g++ or the CPU ISA probe")
    torch._inductor.compile_fx.compile_fx = torch._inductor.compile_fx.compile_fx_inner = forbidden
    torch._inductor.aoti_compile_and_package = torch._inductor.standalone_compile = forbidden
if sys.argv[5] == "forbid_gxx":
    torch._inductor.cpp_builder.CppBuilder.build = torch._inductor.cpu_vec_isa.VecISA.check_build = forbidden
from fvgraph.runtime.buckets import BucketSpec
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.request import Request
cache_dir, backend, out = sys.argv[1:4]
engine = Engine.from_card("tiny-wan", opt_level=1, device="cpu", cache_dir=cache_dir,
                          compile_config=CompileConfig(backend=backend, artifact_format=sys.argv[6]),
                          buckets=BucketSpec(batch_sizes=(1,)))
[result] = engine.warmup([Request(**json.loads(sys.argv[4]))])
torch.save(result.latents, out)
print(json.dumps(engine.counters.snapshot()))
"""


def engine(cache_dir, backend="aot_eager", buckets=(1,), artifact_format="standalone") -> Engine:
    config = CompileConfig(backend=backend, artifact_format=artifact_format)
    return Engine.from_card("tiny-wan", opt_level=1, device="cpu", cache_dir=cache_dir, compile_config=config,
                            buckets=BucketSpec(batch_sizes=buckets))  # fmt: skip


def serve_in_fresh_process(cache_dir, backend, tmp_path, inductor_dir=None, forbid="allow",
                           artifact_format="standalone") -> tuple[dict, torch.Tensor]:  # fmt: skip
    env = dict(os.environ)
    if inductor_dir is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    out = tmp_path / "latents.pt"
    args = [str(cache_dir), backend, str(out), json.dumps(REQUEST), forbid, artifact_format]
    done = subprocess.run([sys.executable, "-c", SERVE, *args], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), torch.load(out)


def step_artifacts(cache_dir) -> list[Path]:
    return sorted(Path(cache_dir).glob("*/*/*-step.*"))


@pytest.mark.parametrize("artifact_format", ["standalone", "aoti"])
def test_a_fresh_process_serves_from_the_cache_with_zero_compiles(tmp_path, artifact_format):
    """inductor: the warm process, with an empty inductor cache of its own, loads the artifacts and
    runs no inductor compile. From AOTInductor packages it runs no compiler at all: not g++, not
    inductor's CPU ISA probe (which builds programs with g++ when a package is opened with
    aoti_load_package), and writes nothing into its inductor cache. A standalone artifact's C++
    kernels are built by g++ at its first load on a CPU (graph_artifact), so g++ is allowed there."""
    cold = engine(tmp_path / "cache", backend="inductor", artifact_format=artifact_format)
    [result] = cold.warmup([Request(**REQUEST)])
    assert cold.counters.compiles == 1 and cold.counters.capture_cache_stores == 1  # the CFG denoise step at batch 1
    assert [p.suffix for p in step_artifacts(tmp_path / "cache")] == [".bin" if artifact_format == "standalone" else ".pt2"]

    inductor_dir = tmp_path / "ind"
    forbid = "forbid_gxx" if artifact_format == "aoti" else "forbid"
    counters, latents = serve_in_fresh_process(tmp_path / "cache", "inductor", tmp_path, inductor_dir, forbid, artifact_format)
    assert counters["compiles"] == 0 and counters["capture_cache_hits"] == 1 and counters["compiled_steps"] == 2
    assert counters["capture_cache_rejects"] == 0
    torch.testing.assert_close(latents, result.latents, rtol=0, atol=0)  # the very same compiled code
    if artifact_format == "aoti":
        assert [p for p in inductor_dir.rglob("*") if p.is_file()] == []
    assert verify(tmp_path / "cache") == []


@pytest.fixture(scope="module")
def warmed(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """One aot_eager warmup of REQUEST into a cache of this module, and the latents it produced."""
    root = tmp_path_factory.mktemp("warmed") / "cache"
    [result] = engine(root).warmup([Request(**REQUEST)])
    assert result.ok and verify(root) == [] and len(step_artifacts(root)) == 1
    return root, result.latents


@pytest.fixture
def warm_cache(warmed, tmp_path) -> tuple[Path, torch.Tensor]:
    """A copy of the warmed cache of this test's own (tests corrupt and add entries), and the warmup's latents."""
    root, latents = warmed
    shutil.copytree(root, tmp_path / "cache")
    return tmp_path / "cache", latents


def test_a_warm_engine_runs_frozen_and_names_what_the_cache_lacks(warm_cache):
    cache_dir, _ = warm_cache
    warm = engine(cache_dir)
    warm.freeze()  # fail_on_recompile from the start: cache loads are allowed, compiles are not
    with warm.counters.expect(compiles=0, capture_cache_hits=1, compiled_steps=2):
        assert warm.generate([Request(**REQUEST)])[0].ok
    [other] = warm.generate([Request(**{**REQUEST, "height": 48})])
    assert other.status == "failed" and "RecompileError" in other.error and "fvgraph warmup" in other.error


def test_a_corrupted_artifact_is_detected_rebuilt_and_the_result_is_unchanged(warm_cache, caplog):
    cache_dir, reference_latents = warm_cache
    [artifact] = step_artifacts(cache_dir)
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0xFF
    artifact.write_bytes(bytes(data))
    assert any("sha256" in line for line in verify(cache_dir))

    again = engine(cache_dir)
    with caplog.at_level(logging.WARNING, "fvgraph.compile.compiler"), again.counters.expect(compiles=1, capture_cache_rejects=1, capture_cache_hits=0):
        [result] = again.generate([Request(**REQUEST)])
    assert "corrupted" in caplog.text
    torch.testing.assert_close(result.latents, reference_latents, rtol=0, atol=0)
    assert verify(cache_dir) == [] and not artifact.exists()  # rebuilt under a new content hash


@pytest.mark.parametrize(("factor", "value"), [("torch", "0.0.0-other"), ("cpu_isa", "aarch64 SVE256 -")])
def test_a_changed_runtime_factor_is_not_served_and_says_which(warm_cache, monkeypatch, caplog, factor, value):
    """A cache built by another torch, or on a CPU with another vector ISA, is rebuilt, never loaded."""
    cache_dir, _ = warm_cache
    other_runtime = dataclasses.replace(RuntimeFactors.current(torch.device("cpu")), **{factor: value})
    monkeypatch.setattr(RuntimeFactors, "current", classmethod(lambda cls, device: other_runtime))
    other = engine(cache_dir)
    with caplog.at_level(logging.WARNING, "fvgraph.compile.capture_cache"), other.counters.expect(compiles=1, capture_cache_hits=0):
        assert other.generate([Request(**REQUEST)])[0].ok
    assert f"{factor}: " in caplog.text and value in caplog.text
    assert len(list(cache_dir.glob("*/manifest.json"))) == 2  # one directory per process identity


# -- CaptureCache itself: fingerprints, foreign entries, truncation (no compiling) ---------------------

FINGERPRINT = dict(card_id="tiny-wan", weights_version="w1", opt_level=1, pass_pipeline="p1", backend="inductor",
                   artifact_kind="standalone", mode="default", torch="2.13.0", triton="3.7.0", cuda=None, gpu=None, cpu_isa="x86_64 AVX2 avx2")  # fmt: skip
FACTORS = dict(step_kind="denoise_cfg", batch=1, runtime=dict(torch="2.13.0"))


def published(root, fingerprint=FINGERPRINT) -> tuple[CaptureCache, CacheEntry]:
    cache = CaptureCache(root, fingerprint)
    with cache.staging_dir() as staging:
        artifact = Path(staging) / "step.pt2"
        artifact.write_bytes(os.urandom(4096))
        entry = cache.publish("k1", FACTORS, {"step": artifact}, meta={"param_names": []})
    return cache, entry


@pytest.mark.parametrize("factor", sorted(FINGERPRINT))
def test_each_fingerprint_factor_separates_caches_and_the_miss_names_it(tmp_path, factor, caplog):
    published(tmp_path)
    changed = {**FINGERPRINT, factor: f"{FINGERPRINT[factor]}-changed"}
    with caplog.at_level(logging.WARNING, "fvgraph.compile.capture_cache"):
        assert CaptureCache(tmp_path, changed).find("k1") is None
    if factor == "card_id":  # another model's cache is not a stale copy of ours: nothing to explain
        assert caplog.text == ""
    else:
        assert f"{factor}: " in caplog.text
    assert CaptureCache(tmp_path, dict(FINGERPRINT)).find("k1") is not None


def test_an_entry_whose_factors_differ_from_the_signature_is_foreign(tmp_path):
    cache, entry = published(tmp_path)
    assert cache.check(entry, FACTORS) is None
    problem = cache.check(entry, {**FACTORS, "runtime": dict(torch="2.12.0")})
    assert problem.startswith("foreign") and "runtime" in problem


def test_a_truncated_or_missing_or_escaping_artifact_is_rejected(tmp_path):
    cache, entry = published(tmp_path)
    path = cache.path(entry, "step")
    path.write_bytes(path.read_bytes()[:100])
    assert "truncated" in cache.check(entry, FACTORS)
    path.unlink()
    assert "missing" in cache.check(entry, FACTORS)
    escaping = CacheEntry("k1", {**entry.record, "artifacts": {"step": {**entry.record["artifacts"]["step"], "file": "../../x"}}})
    assert "outside" in cache.check(escaping, FACTORS)


def test_capture_times_are_recorded_beside_an_entry_without_touching_its_checks(tmp_path):
    cache, entry = published(tmp_path)
    cache.annotate("k1", capture_seconds=0.25)
    cache.annotate("not-there", capture_seconds=1.0)  # nothing to annotate: no error, no entry made
    assert cache.entries()["k1"]["meta"] == {"param_names": [], "capture_seconds": 0.25}
    assert set(cache.entries()) == {"k1"} and verify(tmp_path, load=False) == []  # random bytes: hashed, not loaded


def test_an_unreadable_manifest_is_ignored_and_rewritten(tmp_path, caplog):
    cache, _ = published(tmp_path)
    (cache.dir / "manifest.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, "fvgraph.compile.capture_cache"):
        assert cache.find("k1") is None
    assert "unreadable" in caplog.text
    published(tmp_path)
    assert cache.find("k1") is not None


# -- the CLI: racing warmups, ls, verify, clear ----------------------------------------------------


def warmup_cli(cache_dir, *extra) -> subprocess.Popen:
    args = ["warmup", "--cache-dir", str(cache_dir), "--compile-backend", "aot_eager", "-O", "1", "--buckets", "1",
            "--shape", SHAPE, "--guidance", str(REQUEST["guidance_scale"]), "--device", "cpu", *extra]  # fmt: skip
    return subprocess.Popen([sys.executable, "-m", "fvgraph", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def fvgraph_cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}  # rich wraps at 80 columns without a terminal
    return subprocess.run([sys.executable, "-m", "fvgraph", *args], capture_output=True, text=True, timeout=300, env=env)


def fvgraph_in_process(*args):
    """The same command through typer's test runner in this process (no interpreter start-up and
    imports to pay for commands that only read files): (exit code, output with its whitespace made
    single spaces, stdout). The console is 200 columns wide, as fvgraph_cli's COLUMNS makes it, and
    whatever rich still wraps joins back into one line."""
    from fvgraph.cli.options import console

    width = console._width
    console.width = 200
    try:
        result = CliRunner().invoke(app, list(args))
    finally:
        console._width = width
    return result.exit_code, " ".join(result.output.split()), result.stdout


def test_two_warmups_racing_on_one_directory_leave_a_valid_cache(tmp_path):
    cache = tmp_path / "cache"
    racers = [warmup_cli(cache), warmup_cli(cache)]
    for racer in racers:
        _, err = racer.communicate(timeout=600)
        assert racer.returncode == 0, err[-3000:]
    assert verify(cache) == []
    assert len(step_artifacts(cache)) == 1  # the first writer's entry stands; the other's was discarded

    counters, _ = serve_in_fresh_process(cache, "aot_eager", tmp_path)
    assert counters["compiles"] == 0 and counters["capture_cache_hits"] == 1

    served = fvgraph_cli("generate", "--cache-dir", str(cache), "--fail-on-recompile", "-O", "1", "--compile-backend",
                         "aot_eager", "--device", "cpu", "--steps", "2", "--guidance", str(REQUEST["guidance_scale"]),
                         "--frames", "5", "--height", "32", "--width", "32", "-o", str(tmp_path / "v.gif"))  # fmt: skip
    assert served.returncode == 0 and "compiles: 0, cache hits: 1" in served.stdout, served.stdout + served.stderr

    # ls, verify and clear only read and remove files: they run in this process
    code, _, listing = fvgraph_in_process("cache", "ls", "--cache-dir", str(cache), "--json")
    assert code == 0
    [(directory, listed)] = json.loads(listing).items()
    [(key, record)] = listed["entries"].items()
    assert listed["fingerprint"]["card_id"] == "tiny-wan" and record["factors"]["step_kind"] == "denoise_cfg"
    assert record["artifacts"]["step"]["bytes"] > 0 and record["meta"]["compile_seconds"] > 0
    assert fvgraph_in_process("cache", "verify", "--cache-dir", str(cache))[0] == 0

    [artifact] = step_artifacts(cache)
    artifact.write_bytes(artifact.read_bytes()[:-1])
    code, output, _ = fvgraph_in_process("cache", "verify", "--cache-dir", str(cache))
    assert code == 1 and key in output and "truncated" in output

    (cache / "README.md").write_text("kept")
    assert fvgraph_in_process("cache", "clear", "--cache-dir", str(cache), "--yes")[0] == 0
    assert [p.name for p in cache.iterdir()] == ["README.md"]


@pytest.mark.parametrize(("args", "message"), [
    (["-O", "0"], "takes -O1, -O2 or -O3"),
    (["--shape", "5x32"], "FRAMESxHEIGHTxWIDTH"),
    (["--buckets", "2,1"], "ascending"),
    (["--artifact-format", "zip"], "--artifact-format='zip' must be auto, standalone or aoti"),
])  # fmt: skip
def test_warmup_rejects_bad_options_naming_them(tmp_path, args, message):
    code, output, _ = fvgraph_in_process("warmup", "--cache-dir", str(tmp_path), "--compile-backend", "aot_eager", *args)
    assert code == 2 and message in output


def test_a_graph_that_cannot_be_stored_is_still_served(tmp_path, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise RuntimeError("this graph cannot be packaged")

    monkeypatch.setattr("fvgraph.compile.compiler.save_graph", refuse)
    served = engine(tmp_path)
    with caplog.at_level(logging.WARNING, "fvgraph.compile.compiler"), served.counters.expect(compiles=1, capture_cache_stores=0):
        assert served.generate([Request(**REQUEST)])[0].ok
    assert "cannot be packaged" in caplog.text and verify(tmp_path) == [] and not step_artifacts(tmp_path)
