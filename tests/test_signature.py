"""The CompileCache signature: every factor changes the key; equal inputs give equal keys anywhere."""

import dataclasses
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fvgraph.contract.plan import ShapeSignature
from fvgraph.compile.signature import RuntimeFactors, StepSignature, cpu_isa

BASE = dict(
    card_id="tiny-wan", weights_version="abc", component="transformer", loop="t2v", step_kind="denoise_cfg",
    shape=ShapeSignature("denoise_cfg", (("latents", (16, 2, 8, 8), "float32"), ("timestep", (), "int64"))),
    batch=1, precision="fp32", pass_pipeline="p1", backend="inductor", mode="default",
    runtime=RuntimeFactors(torch="2.13.0", triton=None, cuda=None, gpu=None, cpu_isa="x86_64 AVX2 avx2"),
)  # fmt: skip

CHANGES = {
    "card_id": "wan2.1-t2v-1.3b",
    "weights_version": "abd",
    "component": "vae",
    "loop": "i2v",
    "step_kind": "denoise",
    "shape": ShapeSignature("denoise_cfg", (("latents", (16, 2, 8, 10), "float32"), ("timestep", (), "int64"))),
    "batch": 2,
    "precision": "bf16",
    "pass_pipeline": "p2",
    "backend": "aot_eager",
    "mode": "max-autotune-no-cudagraphs",
    "runtime": RuntimeFactors(torch="2.11.0", triton=None, cuda=None, gpu=None, cpu_isa="x86_64 AVX2 avx2"),
    "attention": "CUDNN_ATTENTION,FLASH_ATTENTION",
    "parallel": "cfg2xulysses1:rank1",
    "adapters": "lora-slots:4x64/2:0123456789ab",
}


def test_every_factor_is_covered():
    assert set(CHANGES) == {f.name for f in dataclasses.fields(StepSignature)}


@pytest.mark.parametrize("factor", sorted(CHANGES))
def test_changing_one_factor_changes_the_key(factor):
    base = StepSignature(**BASE)
    changed = dataclasses.replace(base, **{factor: CHANGES[factor]})
    assert changed.key() != base.key()
    assert [line.split(":")[0] for line in changed.diff(base)] == [factor]


@pytest.mark.parametrize("field", ["triton", "cuda", "gpu", "cpu_isa"])
def test_each_runtime_factor_changes_the_key(field):
    base = StepSignature(**BASE)
    runtime = dataclasses.replace(base.runtime, **{field: "x"})
    assert dataclasses.replace(base, runtime=runtime).key() != base.key()


def test_the_cpu_isa_is_read_without_compiling_and_follows_aten_cpu_capability(tmp_path):
    """A process held to a lower ISA (ATEN_CPU_CAPABILITY=default) has another cpu_isa, so another
    fingerprint: it never loads a library built for the full ISA. Reading it builds nothing."""
    code = ("import torch._inductor.cpp_builder as b\n"
            "b.CppBuilder.build = lambda self: (_ for _ in ()).throw(AssertionError('g++ ran'))\n"
            "from fvgraph.compile.signature import cpu_isa; print(cpu_isa())")  # fmt: skip
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    full = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout.strip()
    lowered = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**env, "ATEN_CPU_CAPABILITY": "default"}).stdout.strip()  # fmt: skip
    assert full == cpu_isa() and full.split()[0] == platform.machine()
    assert lowered.split()[1] == "DEFAULT"
    assert lowered != full or full.split()[1] == "DEFAULT"  # this CPU vectorizes: holding it back shows


def test_key_is_stable_across_processes():
    code = "import test_signature as t; from fvgraph.compile.signature import StepSignature; print(StepSignature(**t.BASE).key())"
    here = Path(__file__).parent  # importable from there, wherever the suite runs from
    keys = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=here).stdout.strip()
        for _ in range(2)
    }
    assert keys == {StepSignature(**BASE).key()}


def test_str_prints_every_factor():
    text = str(StepSignature(**BASE))
    for name in ("card_id", "weights_version", "pass_pipeline", "backend", "runtime.torch", "runtime.gpu", "shape.latents"):
        assert name in text


def test_denoise_steps_declare_their_attention_shape(tiny_engine):
    """The SDPA backend choice is made per (tokens, head_dim, dtype): Wan patches latents 1x2x2."""
    step = tiny_engine.executor.steps["denoise_cfg"]
    inputs = {"latents": torch.zeros(1, 16, 9, 60, 104), "prompt_embeds": torch.zeros(1, 32, 32, dtype=torch.bfloat16)}
    head_dim = tiny_engine.loop.components.transformer.config.attention_head_dim
    assert step.attention_shape(inputs) == (9 * 30 * 52, head_dim, torch.bfloat16)
