# The README's first two commands. Both start with `setup`, so each works on a fresh machine.
PYTHON ?= python3

.PHONY: setup browser demo test test-gpu-torch

# torch first: a plain `torch` requirement pulls a multi-GB CUDA build on a CPU machine, so install the
# pinned CPU release where no torch is present, and keep whatever torch a GPU machine already has.
# triton: the CPU torch build does not bring it; the kernel tests run the Triton kernels on its CPU
# interpreter (TRITON_INTERPRET=1). It stays an optional import for the runtime itself.
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==2.13.0"
	@$(PYTHON) -c "import triton" 2>/dev/null || $(PYTHON) -m pip install -q "triton==3.7.0"
	$(PYTHON) -m pip install -q -e ".[test]"

# The playground's browser test (tests/test_playground_browser.py) drives Debian's chromium through
# its chromedriver; selenium is pointed at both, so nothing downloads a browser. Installed from apt
# (as root, or through sudo) where either is missing; a machine that has both skips this.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		command -v apt-get >/dev/null || { echo "install chromium and its chromedriver at /usr/bin (Debian: chromium chromium-driver)"; exit 1; }; \
		$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	fi

# -O0: the eager path starts at once (-O1, the commands' default, compiles the denoise step first).
demo: setup
	$(PYTHON) -m fvgraph generate tiny-wan -O0 --prompt "a red fox running through fresh snow" --output outputs/tiny-wan.gif

# The suite also runs the Ray Serve replicas test (tests/test_ray_serve.py): the ray extra comes first;
# and the playground in a headless chromium (`browser` above).
# Two pytest-xdist workers, each taking whole files (--dist loadfile: a file's module-scoped engines
# are built once and its tests keep their order). Most of the suite's time is single-threaded
# tracing, so two workers use both cores of a 2-core machine. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: setup browser
	$(PYTHON) -m pip install -q -e ".[test,ray]"
	$(PYTHON) -m pytest -m "not gpu" -q -n $(TEST_WORKERS) --dist loadfile

# The CPU suite under the torch and triton of the reference GPU machine (torch 2.11, triton 3.6), in a
# venv of its own (about 5 GB: PyPI's torch 2.11 is a CUDA build, which runs on the CPU too). Run it
# before a GPU check, so the GPU's minutes are not spent on an API that moved between torch releases.
COMPAT_VENV ?= .venv-torch2.11
test-gpu-torch: browser
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q "torch==2.11.0" "triton==3.6.0"
	$(COMPAT_VENV)/bin/python -m pip install -q -e ".[test]"
	$(COMPAT_VENV)/bin/python -m pytest -m "not gpu" -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile
