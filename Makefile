# bge-triton-kit: every target sets itself up from nothing (venv + pinned dependencies).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-unit bench help compose-check gpu-wheels gpu-bench

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip wheel setuptools
	$(PY) -m pip install --quiet -c requirements.lock -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install the kit with pinned dependencies

demo: setup  ## export BGE-Large-zh (or synthetic), start local Triton, embed, stop; then the quick bench
	$(PY) -m kit.demo
	$(PY) -m loadtest.bench --quick --out reports/demo

test: setup  ## the whole suite: unit + integration against a real local tritonserver
	$(PY) -m pytest

test-unit: setup  ## unit tests only (no server)
	$(PY) -m pytest -m "not integration"

bench: setup  ## the seed-table benchmark on the local Triton (reports/bench)
	$(PY) -m loadtest.bench --out reports/bench

compose-check: setup  ## validate docker-compose.yml and the GPU configs (Triton schema + ORT backend keys)
	docker-compose --env-file deploy/.env.example config -q
	$(PY) deploy/check_configs.py model_repository

gpu-wheels:  ## download what a bare GPU host lacks into loadtest/gpu/wheels (needs PyPI)
	bash loadtest/gpu/fetch_wheels.sh

gpu-bench:  ## on a bare GPU host: the bench with synthetic:bge-large-zh in torch FP16 -> reports/gpu
	bash loadtest/gpu/run.sh
