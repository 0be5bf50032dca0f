#!/usr/bin/env bash
# Fetch, on a machine with a package index, the wheels the reference GPU machine lacks into ./wheels/
# (git-ignored), for perf/gpu_check.sh to install there. That machine (Python 3.12, torch 2.11, CUDA 13)
# already has transformers, tokenizers, safetensors, huggingface-hub, accelerate, typer, rich, numpy
# and pillow; it lacks diffusers, peft and pydantic and what they need beyond that list, and the HTTP
# server's stack (fastapi, uvicorn, PyAV, ...) and the openai client its tests use. One version of each,
# all pure Python or manylinux x86_64, about 48 MB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  # what perf/gpu_check.sh builds fvgraph with (pyproject's build-system; no index there to fetch it)
  setuptools==80.9.0
  diffusers==0.42.1 importlib-metadata==8.7.0
  # LoRA adapters: diffusers' loaders build peft's LoraConfig (bench_lora, the adapter tests)
  peft==0.21.2
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.7.0 typing-inspection==0.4.5
  # fvgraph serve --port (bench_http): the HTTP stack, metrics and PyAV (its wheel alone is most of the 47 MB)
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 anyio==4.16.0 idna==3.20
  uvicorn==0.54.0 h11==0.16.0 python-multipart==0.0.34 prometheus-client==0.26.0 av==18.1.0
  # the official client the HTTP tests drive the server with (tests/test_http_gpu.py)
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1
)
# FVGRAPH_WHEELS_PYTHON: the Python the wheels are for (the GPU machine's 3.12 by default; a CPU rehearsal
# of perf/gpu_check.sh on another Python fetches for that one).
PYTHON_VERSION="${FVGRAPH_WHEELS_PYTHON:-3.12}"
rm -rf wheels && mkdir -p wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d wheels "${WHEELS[@]}"
ls -1 wheels
du -sh wheels
