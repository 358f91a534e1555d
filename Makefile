# Two commands on a fresh clone (Python 3.11, no torch needed beforehand):
#   make demo   set everything up, then run the main job (smx demo)
#   make test   set everything up, then run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
TORCH_CPU_WHEEL_VERSION = 2.13.0
# Where pip finds the CPU build of torch. Empty: pip's configured indexes (on this project's
# machines that is the CPU wheel on local disk). Elsewhere, point it at PyTorch's CPU wheel index,
# e.g. make test TORCH_INDEX=<cpu wheel index URL>, or plain PyPI gives the (larger) CUDA build.
TORCH_INDEX ?=

.PHONY: setup demo test bench clean

setup: $(VENV)/.smx-installed

# pip never resolves torch on its own: the CPU wheel is pinned when no torch is present,
# and pyproject.toml's torch range is then already satisfied.
$(VENV)/.smx-installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "torch==$(TORCH_CPU_WHEEL_VERSION)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: setup
	$(BIN)/smx demo $(ARGS)

# The suite runs on PYTEST_WORKERS processes (pytest-xdist; a test file stays on one worker, so its
# module fixtures are built once). PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= 2

test: setup
	$(BIN)/python -m pytest -q -ra $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile) $(ARGS)

bench: setup
	$(BIN)/python benchmarks/bench_softmax.py $(ARGS)

clean:
	rm -rf $(VENV) smx-demo-out .pytest_cache
