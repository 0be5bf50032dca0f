"""What this process runs on: the versions and devices that decide which compiled artifacts apply."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform

import torch

# import name -> distribution name of the optional packages fvgraph's kernels use: Triton runs them,
# nsight-python profiles them (perf/bench_kernels.py). Import-guarded everywhere.
OPTIONAL_KERNEL_PACKAGES = {
    "triton": "triton",
    "nsight": "nsight-python",
}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "optional_kernels": {
            name: {"importable": importlib.util.find_spec(name) is not None, "version": _version(dist)}
            for name, dist in OPTIONAL_KERNEL_PACKAGES.items()
        },
    }
