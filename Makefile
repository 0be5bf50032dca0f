# The README's first two commands. Both start with `setup`, so each works on a fresh machine.
PYTHON ?= python3

.PHONY: setup demo test

# torch first: a plain `torch` requirement pulls a multi-GB CUDA build on a CPU machine, so install the
# pinned CPU release where no torch is present, and keep whatever torch a GPU machine already has.
# triton: the CPU torch build does not bring it; the kernel tests run the Triton kernels on its CPU
# interpreter (TRITON_INTERPRET=1). It stays an optional import for the runtime itself.
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==2.13.0"
	@$(PYTHON) -c "import triton" 2>/dev/null || $(PYTHON) -m pip install -q "triton==3.7.0"
	$(PYTHON) -m pip install -q -e ".[test]"

demo: setup
	$(PYTHON) -m fvgraph generate --card tiny-wan --prompt "a red fox running through fresh snow" --output outputs/tiny-wan.gif

test: setup
	$(PYTHON) -m pytest -m "not gpu" -q
