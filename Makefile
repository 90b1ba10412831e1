# bge-triton-kit: every target sets itself up from nothing (venv + pinned dependencies).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test lint test-unit bench tune stack-bench chaos locust help compose-check gpu-wheels gpu-bench deploy-test images

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip wheel setuptools
	$(PY) -m pip install --quiet -c requirements.lock -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install the kit with pinned dependencies

demo: setup  ## export BGE-Large-zh (or synthetic), start local Triton, embed, stop; then the quick emulated seed table
	$(PY) -m bge_triton.cli demo
	$(PY) -m bge_triton.cli bench seed --quick --executor costmodel --scenarios no_batching,static_32,dynamic_5ms,delay_0 --out reports/demo

test: setup lint  ## lint + types, then the whole suite: unit, integration (a real local tritonserver), deploy (podman)
	$(PY) -m pytest

lint: setup  ## ruff (rule set in pyproject.toml) and mypy (strict on client/, gateway/, the text endpoint's pure modules)
	$(VENV)/bin/ruff check src tests deploy
	$(VENV)/bin/mypy

test-unit: setup  ## unit tests only (no server)
	$(PY) -m pytest -m "not integration and not deploy"

bench: setup  ## seed table: URL=HOST:PORT measures your running Triton (docs/tuning.md); else the local one (real CPU + EMULATED GPU rows, ~6 min); BENCH_ARGS=--quick
	$(if $(URL),$(PY) -m bge_triton.cli bench seed --url $(URL) $(BENCH_ARGS),$(PY) -m bge_triton.cli bench seed --out reports/bench $(BENCH_ARGS))

tune: setup  ## queue-delay tuner: URL=HOST:PORT SLO=50 on your running Triton (docs/tuning.md); else the emulated GPU; TUNE_ARGS=--write ...
	$(if $(URL),$(PY) -m bge_triton.cli tune --url $(URL) --slo-p99-ms $(or $(SLO),50) $(TUNE_ARGS),$(PY) -m bge_triton.cli tune --slo-p99-ms 50 --rate 600 --repeats 3 --out reports/tune $(TUNE_ARGS))

stack-bench: setup  ## full stack vs raw ONNX Runtime + padding ratio (reports/stack)
	$(PY) -m bge_triton.cli bench stack --out reports/stack

chaos: setup  ## bad input, overload, faults (reports/chaos)
	$(PY) -m bge_triton.cli chaos --out reports/chaos

locust: setup  ## shaped Locust load on a running server: LOCUST_ARGS="--host http://127.0.0.1:8000 -u 32 -r 8 -t 120s ..." (docs/loadtest.md)
	$(PY) -m locust -f src/bge_triton/loadtest/locustfile.py --headless $(LOCUST_ARGS)

compose-check: setup  ## validate docker-compose.yml (+ override, + the CPU override), the GPU configs (Triton schema + ORT backend keys) and Prometheus' config and alert rules
	docker-compose --env-file deploy/.env.example config -q
	docker-compose --env-file deploy/.env.example -f docker-compose.yml -f docker-compose.cpu.yml config -q
	$(PY) deploy/check_configs.py src/bge_triton/model_repository
	promtool check config deploy/prometheus/prometheus.yml  # and its alert rules (Debian: apt-get install prometheus)

gpu-wheels: $(STAMP)  ## what a bare GPU host lacks (wheels, tokenizer, review sample) -> src/bge_triton/loadtest/gpu/wheels (needs PyPI)
	KIT_PYTHON=$(PY) bash src/bge_triton/loadtest/gpu/fetch_wheels.sh

gpu-bench:  ## on a bare GPU host: the bench with synthetic:bge-large-zh in torch FP16 -> reports/gpu
	bash src/bge_triton/loadtest/gpu/run.sh

images:  ## with podman: the base + stand-ins when missing (deploy/standins), then every image from `git archive HEAD`
	bash deploy/standins/build.sh
	bash deploy/build-images.sh

deploy-test: setup  ## build every image from a clean archive on the stand-ins; compose (CPU override): the docs' examples, tune --apply and bench seed --url; kube play of docs/k8s.md's steps (tests/deploy)
	$(PY) -m pytest -m deploy tests/deploy
	@cat .kit/deploy-test-timings.txt 2>/dev/null || true
