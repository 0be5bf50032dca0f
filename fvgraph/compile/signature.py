"""StepSignature: the CompileCache key, the explicit list of everything that changes a compiled step.

A factor left out of a key is how a cache serves a wrong artifact (vllm#16150, #53366, #27285), so
every factor is a named field, the hash is a stable sha256 of their JSON (equal across processes and
machines), and `str()` prints them one per line so a mismatch can be read off.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import platform
from dataclasses import dataclass

import torch

from fvgraph.contract.plan import ShapeSignature


def _triton_version() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_isa() -> str:
    """The host CPU's vector ISA as torch reads it from the CPU itself, e.g. `x86_64 AVX512 avx2+avx512`:
    the architecture, ATen's dispatch capability (ATEN_CPU_CAPABILITY lowers it) and, on x86, the
    extensions inductor chooses its ISA from. An AOTInductor library holds host code built for one
    ISA (all of it on a CPU), and one built for AVX-512 dies of SIGILL on a CPU without it. Nothing is
    compiled to find this (inductor's own pick_vec_isa builds probe programs with g++)."""
    from torch._inductor.cpu_vec_isa import x86_isa_checker

    return f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()} {'+'.join(x86_isa_checker()) or '-'}"


@dataclass(frozen=True)
class RuntimeFactors:
    """The toolchain and device: what a compiled artifact was built with and for."""

    torch: str
    triton: str | None
    cuda: str | None
    gpu: str | None
    cpu_isa: str  # see cpu_isa(): the host code of every artifact is built for it

    @classmethod
    def current(cls, device: torch.device) -> RuntimeFactors:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        return cls(torch.__version__, _triton_version(), torch.version.cuda, gpu, cpu_isa())


@dataclass(frozen=True)
class StepSignature:
    card_id: str
    weights_version: str
    component: str  # the model component the step runs (transformer, vae, text_encoder)
    loop: str
    step_kind: str
    shape: ShapeSignature  # every input's shape past the batch dim, and dtype
    batch: int  # the batch bucket the graph is built for
    precision: str
    pass_pipeline: str  # uuid of the pass pipeline (sources + config)
    backend: str  # eager | aot_eager | inductor
    mode: str  # inductor mode ("default", "max-autotune-no-cudagraphs", ...)
    runtime: RuntimeFactors
    attention: str = "default"  # SDPA backends the step was compiled with, in priority order
    parallel: str = "single"  # the parallel plan and this rank's place in it (ParallelConfig.plan)
    adapters: str = "none"  # LoRA slot count, rank, per-request count and adapted linears (never which adapters)

    def factors(self) -> dict:
        return dataclasses.asdict(self)

    @functools.cached_property
    def _key(self) -> str:
        blob = json.dumps(self.factors(), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    def key(self) -> str:
        return self._key  # computed once: it is read on every batch

    @functools.cached_property
    def unbatched_key(self) -> str:
        """The key of this step at any batch bucket: what its graphs at every bucket share (a request's
        hoisted values, computed at one bucket, serve it at all of them)."""
        return dataclasses.replace(self, batch=0).key()

    def __str__(self) -> str:
        lines = [f"StepSignature {self.key()}"]
        for name, value in self.factors().items():
            if name == "shape":
                lines.append(f"  shape.kind: {value['kind']}")
                lines += [f"  shape.{n}: {list(s)} {d}" for n, s, d in value["inputs"]]
            elif name == "runtime":
                lines += [f"  runtime.{k}: {v}" for k, v in value.items()]
            else:
                lines.append(f"  {name}: {value}")
        return "\n".join(lines)

    def diff(self, other: StepSignature) -> list[str]:
        """The factors that differ, as 'name: ours != theirs' lines (for recompile errors)."""
        ours, theirs = self.factors(), other.factors()
        return [f"{k}: {ours[k]} != {theirs[k]}" for k in ours if ours[k] != theirs[k]]
