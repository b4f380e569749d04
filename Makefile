# `make demo` and `make test` are the whole set-up on a machine with Python >= 3.12.
# The interpreter: PYTHON if given, else the first of python3, python3.13, python3.12 that is
# 3.12 or newer (pyenv and uv users get one from .python-version).
NEWEST_PYTHON := $(firstword $(foreach p,python3 python3.13 python3.12,$(shell $(p) -c 'import sys; print("$(p)" if sys.version_info >= (3, 12) else "")' 2>/dev/null)))
PYTHON ?= $(NEWEST_PYTHON)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# `make test-min`: the oldest releases pyproject.toml allows (jax 0.11.2, the lent GPU machine's).
MIN_VENV := .venv-min
MIN_STAMP := $(MIN_VENV)/.installed
# The TPU compiler (libtpu) of the installed JAX, for compiling for TPU topologies on this host
# (benchmarks/compile.py, tests/project/test_compile.py). It goes in <venv>/libtpu, outside the
# import path: JAX would otherwise try to start a TPU at every run on a host without one.
# `pip install -e '.[tpu]'` installs it on the path instead (a TPU host).
LIBTPU = $(1)/bin/python -m pip install --quiet --no-deps --target $(1)/libtpu \
	"$$($(1)/bin/python -c 'from importlib.metadata import requires; print(next(r.split(";")[0] for r in requires("jax") if r.startswith("libtpu")))')"
# XLA's GPU compiler for compiling for GPUs on this host (benchmarks/compile.py --topology h100:8,
# tests/project/test_compile.py): jax's CUDA plugin of the installed JAX, with the CUDA compilers it
# calls (ptxas, libdevice), in <venv>/cuda, outside the import path as libtpu (lab.lowering loads it
# when asked for a GPU topology). A GPU host's `pip install 'jax[cuda13]'` serves as well.
CUDA_STAMP = $(1)/cuda/.installed
define CUDA_COMPILER
$(1)/bin/python -m pip install --quiet --no-deps --target $(1)/cuda nvidia-nvvm nvidia-cuda-crt "nvidia-cuda-nvcc>=13.0.48" \
	$$($(1)/bin/python -c 'import jaxlib; v = jaxlib.__version__; print(f"jax-cuda13-plugin=={v} jax-cuda13-pjrt=={v}")')
touch $(call CUDA_STAMP,$(1))
endef
# JAX's persistent compilation cache, outside the clone; a changed program (kernel, shape,
# flag, JAX version) misses it and compiles anew. Tests that must compile fresh turn it off.
# One directory per CPU model and feature set: JAX's cache key names the platform only ("cpu"),
# and an XLA:CPU executable is built for the features of the CPU that compiled it, so a cache
# copied to, or shared with, another kind of machine could hand a worker instructions its CPU lacks.
CPU_TAG := $(shell grep -m2 -E '^(model name|flags)' /proc/cpuinfo 2>/dev/null | cksum | cut -d' ' -f1)
export JAX_COMPILATION_CACHE_DIR ?= $(HOME)/.cache/positional/jax-$(CPU_TAG)
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS ?= 0
# A size limit turns on the cache's file lock: without one, jax writes an entry in place and
# reads it unlocked, so one worker can read what the other is still writing. 4 GiB; the least
# recently used go first.
export JAX_COMPILATION_CACHE_MAX_SIZE ?= 4294967296
# What `make test-min` runs on the oldest releases: kernels, dispatch, vendor calls, lowering and
# compiling for the accelerators, precision, the conformance suite, packaging, and training and
# the data (where the oldest etils, orbax and pyarrow failed).
MIN_TESTS := $(addprefix tests/positional/,test_flash.py test_path_kernel.py test_feedback.py test_vendor.py \
	test_auto.py test_precision.py test_path.py test_conformance.py test_attention.py) \
	$(addprefix tests/project/,test_compile.py test_packaging.py test_benchmarks.py) \
	tests/lab/test_train.py tests/data/test_data.py
# `make test-quick` leaves out the modules that train, evaluate or run several processes (paths
# under tests/, without .py).
QUICK_SKIP := lab/test_train lab/test_runs_safety lab/test_distributed lab/test_eval lab/test_retrieval \
	lab/test_hf_import lab/test_analyze lab/test_evaluators lab/test_sweep lab/test_options models/test_scale positional/test_ring \
	positional/test_perturb positional/test_logit_probes positional/test_lm_infinite data/test_grid2d \
	project/test_seeds project/test_compile project/test_readme
# ... and, in the modules it runs, the compiles through libtpu and the GPU check's run at toy sizes.
QUICK_DESELECT := -k "not compile_for_tpu and not compiles_for_tpu and not gpu_check_runs_end_to_end"

# The lent GPU machine (python3 with jax[cuda] 0.11.2, no network): `make gpu-wheels` here fetches
# what it lacks into .whl (git-ignored: the device call carries it), the releases `make test-min`
# tests; `make gpu-check` there installs them under /tmp/site and runs benchmarks/gpu_check.py
# (its json goes to $OUT). benchmarks/RESULTS.md has the device command.
GPU_WHEELS := flax==0.12.10 optax==0.2.5 ml-collections==1.1.0 sentencepiece==0.2.0
GPU_PYTHON ?= python3
GPU_BUDGET_S ?= 400

.PHONY: python demo demo-fast lint test test-quick test-min test-slow clean gpu-wheels gpu-check

python:
	@"$(PYTHON)" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null || { echo "error: make needs Python >= 3.12 \
	(found: $(or $(PYTHON),none of python3 / python3.13 / python3.12)); install one, or run make PYTHON=/path/to/python3.12" >&2; exit 1; }

$(STAMP): pyproject.toml | python
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --upgrade -e '.[test,hf]'
	$(call LIBTPU,$(VENV))
	@$(PY) -c 'import sys, jax; print(f"installed: Python {sys.version.split()[0]}, jax {jax.__version__}")'
	touch $(STAMP)

$(MIN_STAMP): pyproject.toml | python
	test -x $(MIN_VENV)/bin/python || $(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install --quiet --upgrade pip uv
	$(MIN_VENV)/bin/python -m uv pip install --quiet --python $(MIN_VENV)/bin/python --resolution lowest-direct \
		-e '.[test,hf]'
	$(call LIBTPU,$(MIN_VENV))
	@$(MIN_VENV)/bin/python -c 'import sys, jax; print(f"installed: Python {sys.version.split()[0]}, jax {jax.__version__}")'
	touch $(MIN_STAMP)

$(call CUDA_STAMP,$(VENV)): $(STAMP)
	$(call CUDA_COMPILER,$(VENV))

$(call CUDA_STAMP,$(MIN_VENV)): $(MIN_STAMP)
	$(call CUDA_COMPILER,$(MIN_VENV))

demo: $(STAMP)
	$(PY) demo.py

demo-fast: $(STAMP)
	$(PY) demo.py --fast

lint: $(STAMP)
	$(PY) -m ruff check .

# Two workers (pytest-xdist): compiling dominates, and one process leaves a core idle.
test: lint $(call CUDA_STAMP,$(VENV))
	$(PY) -m pytest -q -n 2

test-quick: lint $(call CUDA_STAMP,$(VENV))
	$(foreach m,$(QUICK_SKIP),$(if $(wildcard tests/$(m).py),,$(error QUICK_SKIP: no file tests/$(m).py)))
	@echo "test-quick leaves out: $(QUICK_SKIP), and the TPU compiles and the GPU check elsewhere (make test runs them)"
	$(PY) -m pytest -q -n 2 $(foreach m,$(QUICK_SKIP),--ignore=tests/$(m).py) $(QUICK_DESELECT)

# The older JAX keeps its own compilation cache: one release need not read what the other wrote.
test-min: $(MIN_STAMP) $(call CUDA_STAMP,$(MIN_VENV))
	JAX_COMPILATION_CACHE_DIR=$(JAX_COMPILATION_CACHE_DIR)-min $(MIN_VENV)/bin/python -m pytest -q -n 2 $(MIN_TESTS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

clean:
	rm -rf runs .pytest_cache

gpu-wheels: $(STAMP)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

gpu-check:
	@if [ -d .whl ]; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
		--upgrade --target /tmp/site .whl/*.whl; fi
	PYTHONPATH=$(CURDIR):/tmp/site PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/gpu_check.py --budget_s $(GPU_BUDGET_S) $(GPU_CHECK_FLAGS)
