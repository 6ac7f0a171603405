# Set-up, demo and tests. Everything installs into .venv; torch is pinned to the CPU build that
# this machine carries on disk (pyproject.toml keeps torch>=2.4 open so users choose their build).
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
export KUBEBUILDER_ASSETS ?= $(shell ../shared/k8s/install.sh 2>/dev/null)

.PHONY: venv demo test lint ruff unit crd
venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

demo: venv
	$(BIN)/sgdjob run examples/quickstart.yaml --out runs/quickstart

TYPED := operator/src trainer/src devcluster tests/devcluster tests/e2e bench

ruff: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

lint: ruff
	$(BIN)/mypy $(TYPED)

# As `lint` then pytest and mypy: tests/run-all.sh runs the real-node tests and the others side by side,
# with mypy beside them at nice 19; any failure or type error fails the target.
test: ruff
	BIN=$(BIN) LOGS=$(VENV) TYPED="$(TYPED)" tests/run-all.sh

unit: venv
	$(BIN)/pytest -q tests/unit

crd: venv
	$(BIN)/sgdjob crd > crds/sgdjobs.sgdjob.dev.yaml
	cp crds/sgdjobs.sgdjob.dev.yaml charts/sgdjob-operator/crds/
