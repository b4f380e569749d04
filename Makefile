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
# `make test-newest`: the newest releases, resolved afresh (not part of `make test` or CI).
NEWEST_VENV := .venv-newest

# ---- the lock ------------------------------------------------------------------------------
# Every venv installs from lock/ (uv's requirements format: exact versions with their hashes,
# which uv checks), so a clone installs on any later day what was tested on the day of the lock:
#   lock/main.txt  .venv (`make demo`, `make test`, CI): pyproject.toml's dependencies with the
#                  extras test and hf, and the compilers (extras tpu, cuda-compile) resolved with
#                  them, so the lock holds a JAX whose TPU compiler is on the index
#   lock/min.txt   .venv-min (`make test-min`): the same at the lowest versions pyproject.toml allows
#   lock/tools.txt uv, pip, and setuptools (the build backend of the editable install)
#   lock/gpu.txt   the wheels the lent GPU machine lacks (`make gpu-wheels`), from lock/min.txt
# `make lock` writes them: after a dependency is added or a bound changed in pyproject.toml (it
# keeps every other version), or, as `make lock UPGRADE=1`, to move every package to its newest
# release on purpose (`make test-newest` tries that first). Commit lock/ alone, with the reason.
LOCK := lock/main.txt
MIN_LOCK := lock/min.txt
TOOLS_LOCK := lock/tools.txt
GPU_LOCK := lock/gpu.txt
VENV_EXTRAS := --extra test --extra hf
LOCK_EXTRAS := $(VENV_EXTRAS) --extra tpu --extra cuda-compile
UV = $(1)/bin/uv
# What the lock was made from: pyproject.toml's dependencies, extras and Python bound (a
# digest, recorded in each lock by `make lock`; a venv is not installed from a lock made from
# others).
DEPS_DIGEST = $(shell "$(PYTHON)" -c 'import hashlib, json, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	print(hashlib.sha256(json.dumps([p["requires-python"], p["dependencies"], p["optional-dependencies"]]).encode()).hexdigest()[:16])' 2>/dev/null)
DIGEST_LINE = \# made from the dependencies of pyproject.toml, digest $(DEPS_DIGEST) (Makefile: DEPS_DIGEST)
# (make's own error line: one line, and make stops before anything is changed)
CHECK_LOCK = $(if $(shell grep -qxF "$(DIGEST_LINE)" $(1) && echo current),,$(error $(1) was not made from \
	pyproject.toml's dependencies as they are now (changed without `make lock`): run make lock, then commit lock/ in a \
	commit of its own))

# A venv made anew from a lock: $(1) the venv, $(2) the lock. Made anew, so it holds what the lock
# says and nothing left from an earlier one; uv's download cache makes that quick.
define INSTALL
$(call CHECK_LOCK,$(2))
rm -rf $(1)
"$(PYTHON)" -m venv $(1)
$(1)/bin/python -m pip --isolated install --quiet --require-hashes --no-deps -r $(TOOLS_LOCK)
$(call UV,$(1)) pip install --quiet --python $(1)/bin/python -c $(2) -b $(TOOLS_LOCK) -e '.[test,hf]'
echo "$(2) sha256:$$(sha256sum $(2) | cut -d' ' -f1)" > $(1)/installed-from
@$(1)/bin/python -c 'import sys, jax; print(f"installed from $(2): Python {sys.version.split()[0]}, jax {jax.__version__}")'
endef

# The compilers for compiling for an accelerator on this host (benchmarks/compile.py, the tests
# that compile for TPU or GPU): the TPU compiler (libtpu) in <venv>/libtpu and jax's CUDA plugin
# with the CUDA compilers it calls (ptxas, libdevice) in <venv>/cuda, both off the import path
# (JAX would otherwise look for a TPU or a GPU at every run; lab.lowering loads them when asked),
# at the versions pyproject.toml's extras tpu and cuda-compile give for the venv's JAX. (`pip
# install -e '.[tpu]'` installs libtpu on the path instead: a TPU host.) They serve only those
# checks: one that cannot be installed leaves one line in <venv>/<name>.missing, printed here and
# given by lab.lowering as the reason its tests skip, and the install goes on.
COMPILERS = $(1)/.compilers
# Why uv failed, in one line, from its log $(1): the resolver's first reason ("Because ... depends on ...",
# which uv wraps to the terminal's width), else its error.
WHY = $$(tr '\n' ' ' < $(1) | tr -s ' ' | grep -oE 'Because.*' | sed -E 's/\. .*/./' | grep . \
	|| grep -m1 -oE '(error|Failed).*' $(1) || head -n1 $(1))
# $(1) the venv, $(2) its folder (libtpu, cuda), $(3) the extra, $(4) the packages it holds,
# $(5) the lock that pins them (empty: the newest releases, and a failure stops make).
define COMPILER
@rm -rf $(1)/$(2) $(1)/$(2).missing
@$(call UV,$(1)) pip freeze --quiet --python $(1)/bin/python --exclude-editable > $(1)/installed.txt
@{ $(call UV,$(1)) pip compile --quiet --python $(1)/bin/python pyproject.toml --extra $(3) -c $(1)/installed.txt \
	$(if $(5),-c $(5)) --no-header -o $(1)/$(2).txt && $(call UV,$(1)) pip install --quiet --python $(1)/bin/python \
	--no-deps --target $(1)/$(2) -c $(1)/$(2).txt $(if $(5),-c $(5)) $(4); } 2>$(1)/$(2).log || { rm -rf $(1)/$(2); \
	why="$(4) (extra $(3), for jax $$($(1)/bin/python -c 'import jax; print(jax.__version__)')) could not be \
	installed: $(call WHY,$(1)/$(2).log)"; \
	$(if $(5),echo "$$why -- the checks that need it are skipped" | tee $(1)/$(2).missing; , \
	echo "error: $$why -- the newest releases cannot be locked together: make test-newest stops here" >&2; exit 1; ) }
endef
define INSTALL_COMPILERS
$(call COMPILER,$(1),libtpu,tpu,libtpu,$(2))
$(call COMPILER,$(1),cuda,cuda-compile,jax-cuda13-plugin jax-cuda13-pjrt nvidia-cuda-nvcc nvidia-nvvm nvidia-cuda-crt,$(2))
@touch $(call COMPILERS,$(1))
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
# ... and, in the modules it runs, the compiles through libtpu (the GPU check's run at toy sizes is slow).
QUICK_DESELECT := -k "not compile_for_tpu and not compiles_for_tpu"

# The lent GPU machine (python3 with jax[cuda] 0.11.2, no network): `make gpu-wheels` here fetches
# what it lacks into .whl (git-ignored: the device call carries it), the releases `make test-min`
# tests (lock/gpu.txt pins them with their hashes); `make gpu-check` there installs them under
# /tmp/site and runs benchmarks/gpu_check.py (its json goes to $OUT). benchmarks/RESULTS.md has
# the device command.
GPU_WHEELS := flax optax ml-collections sentencepiece
GPU_PYTHON ?= python3
GPU_BUDGET_S ?= 400

.PHONY: python lock check-lock demo demo-fast lint test test-quick test-min test-newest test-slow clean gpu-wheels gpu-check

python:
	$(if $(shell "$(PYTHON)" -c 'import sys; print(sys.version_info >= (3, 12) or "")' 2>/dev/null),,$(error make needs \
	Python >= 3.12 (found: $(or $(PYTHON),none of python3 / python3.13 / python3.12)): install one, or run make \
	PYTHON=/path/to/python3.12))

$(STAMP): pyproject.toml $(LOCK) $(TOOLS_LOCK) | python
	$(call INSTALL,$(VENV),$(LOCK))
	touch $(STAMP)

$(MIN_STAMP): pyproject.toml $(MIN_LOCK) $(TOOLS_LOCK) | python
	$(call INSTALL,$(MIN_VENV),$(MIN_LOCK))
	touch $(MIN_STAMP)

$(call COMPILERS,$(VENV)): $(STAMP)
	$(call INSTALL_COMPILERS,$(VENV),$(LOCK))

$(call COMPILERS,$(MIN_VENV)): $(MIN_STAMP)
	$(call INSTALL_COMPILERS,$(MIN_VENV),$(MIN_LOCK))

# Whether lock/ was made from pyproject.toml's dependencies as they are (tests/project/test_install.py).
check-lock: | python
	$(call CHECK_LOCK,$(LOCK))
	$(call CHECK_LOCK,$(MIN_LOCK))

# uv alone, for `make lock` (`make lock` needs no install).
$(call UV,$(VENV)): $(TOOLS_LOCK) | python
	test -x $(PY) || "$(PYTHON)" -m venv $(VENV)
	$(PY) -m pip --isolated install --quiet --require-hashes --no-deps -r $(TOOLS_LOCK)

LOCK_WITH = $(call UV,$(VENV)) pip compile --quiet --universal --python-version 3.12 --generate-hashes \
	--custom-compile-command "make lock" $(if $(UPGRADE),--upgrade)
lock: $(call UV,$(VENV))
	$(LOCK_WITH) pyproject.toml $(LOCK_EXTRAS) -o $(LOCK)
	echo '$(DIGEST_LINE)' >> $(LOCK)
	$(LOCK_WITH) pyproject.toml $(LOCK_EXTRAS) --resolution lowest-direct -o $(MIN_LOCK)
	echo '$(DIGEST_LINE)' >> $(MIN_LOCK)
	printf 'uv\npip\nsetuptools>=68\n' | $(LOCK_WITH) - -o $(TOOLS_LOCK)
	printf '%s\n' $(GPU_WHEELS) | $(LOCK_WITH) - --no-deps -c $(MIN_LOCK) -o $(GPU_LOCK)
	@echo "lock/ written ($$(grep -m1 -oE '^jax==\S+' $(LOCK))): run make test, then commit lock/ in a commit of its own with the reason"

# The newest releases pyproject.toml allows, resolved afresh into their own venv at each call, and
# the suite on them; a release that cannot be installed, a compiler of the newest JAX among them,
# stops it with one line (the lock, which holds the compilers, cannot move there). Not part of
# `make test` or CI: where it passes, `make lock UPGRADE=1` moves the lock to them (README).
test-newest: | python
	rm -rf $(NEWEST_VENV)
	"$(PYTHON)" -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip --isolated install --quiet --require-hashes --no-deps -r $(TOOLS_LOCK)
	@$(call UV,$(NEWEST_VENV)) pip install --quiet --refresh --python $(NEWEST_VENV)/bin/python -e '.[test,hf]' \
		2>$(NEWEST_VENV)/install.log || { echo "error: the newest releases do not install: \
	$(call WHY,$(NEWEST_VENV)/install.log)" >&2; exit 1; }
	@$(NEWEST_VENV)/bin/python -c 'import sys, jax; print(f"installed the newest: Python {sys.version.split()[0]}, jax {jax.__version__}")'
	$(call INSTALL_COMPILERS,$(NEWEST_VENV),)
	$(NEWEST_VENV)/bin/python -m ruff check .
	JAX_COMPILATION_CACHE_DIR=$(JAX_COMPILATION_CACHE_DIR)-newest $(NEWEST_VENV)/bin/python -m pytest -q -n 2

demo: $(STAMP)
	$(PY) demo.py

demo-fast: $(STAMP)
	$(PY) demo.py --fast

lint: $(STAMP)
	$(PY) -m ruff check .

# Two workers (pytest-xdist): compiling dominates, and one process leaves a core idle.
test: lint $(call COMPILERS,$(VENV))
	$(PY) -m pytest -q -n 2

test-quick: lint $(call COMPILERS,$(VENV))
	$(foreach m,$(QUICK_SKIP),$(if $(wildcard tests/$(m).py),,$(error QUICK_SKIP: no file tests/$(m).py)))
	@echo "test-quick leaves out: $(QUICK_SKIP), and the TPU compiles elsewhere (make test runs them)"
	$(PY) -m pytest -q -n 2 $(foreach m,$(QUICK_SKIP),--ignore=tests/$(m).py) $(QUICK_DESELECT)

# The older JAX keeps its own compilation cache: one release need not read what the other wrote.
test-min: $(call COMPILERS,$(MIN_VENV))
	JAX_COMPILATION_CACHE_DIR=$(JAX_COMPILATION_CACHE_DIR)-min $(MIN_VENV)/bin/python -m pytest -q -n 2 $(MIN_TESTS)

test-slow: $(call COMPILERS,$(VENV))
	$(PY) -m pytest -q -m slow

clean:
	rm -rf runs .pytest_cache

gpu-wheels: $(STAMP)
	$(PY) -m pip --isolated download --quiet --no-deps --require-hashes --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl -r $(GPU_LOCK)

gpu-check:
	@if [ -d .whl ]; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
		--upgrade --target /tmp/site .whl/*.whl; fi
	PYTHONPATH=$(CURDIR):/tmp/site PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/gpu_check.py --budget_s $(GPU_BUDGET_S) $(GPU_CHECK_FLAGS)
