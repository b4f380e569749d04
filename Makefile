# `make demo` and `make test` are the whole set-up on a machine with Python 3.11+.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-fast lint test test-slow clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,hf]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) demo.py

demo-fast: $(STAMP)
	$(PY) demo.py --fast

lint: $(STAMP)
	$(PY) -m ruff check .

# Two workers (pytest-xdist): compiling dominates, and one process leaves a core idle.
test: lint
	$(PY) -m pytest -q -n 2

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

clean:
	rm -rf runs .pytest_cache
