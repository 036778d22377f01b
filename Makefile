# Two commands for a new user: `make serve` and `make test`.
# Each creates/updates .venv, installs the pinned dependencies (the CPU torch
# wheel first, so nothing pulls a CUDA build), prepares the default model once,
# then serves / tests. Re-running redoes nothing that is already done.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zerogap-installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test model bench peers matrix stubs clean

$(STAMP): pyproject.toml clients/python/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e ./clients/python
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

model: $(STAMP)
	$(PY) -m service prepare-model

serve: model
	$(PY) -m service serve $(ARGS)

test: model
	$(PY) -m pytest $(PYTEST_ARGS)

bench: model
	$(PY) bench/bench_serving.py $(ARGS)

peers: model
	$(PY) -m pip install -q --disable-pip-version-check -e '.[bench]'
	$(PY) bench/peers.py $(ARGS)

matrix: $(STAMP)
	$(PY) -m service matrix

stubs: $(STAMP)
	$(PY) clients/python/generate_stubs.py

clean:
	rm -rf $(VENV) service/_gen
