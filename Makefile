# Set-up, demo and tests. Everything installs into .venv; torch is pinned to the CPU build that
# this machine carries on disk (pyproject.toml keeps torch>=2.4 open so users choose their build).
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
export KUBEBUILDER_ASSETS ?= $(shell ../shared/k8s/install.sh 2>/dev/null)

.PHONY: venv demo test test-serial lint ruff unit crd
venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev,hf,lightning]"
	touch $@

demo: venv
	$(BIN)/sgdjob run examples/quickstart.yaml --out runs/quickstart

TYPED := operator/src trainer/src devcluster tests/devcluster e2e bench

ruff: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

lint: ruff
	$(BIN)/mypy $(TYPED)

# As `lint` then every test: tests/run-all.sh runs two pytest sessions side by side (the real-node
# tests in the background, the rest here) with mypy beside them at nice 19; any failure in either
# half or a type error fails the target. Both halves mostly wait on processes and containers, so on
# 2 cores the whole run takes about as long as the longer half (CI-like runs: 32-38 min instead of
# 44-48 one after the other).
test: ruff
	BIN=$(BIN) LOGS=$(VENV) TYPED="$(TYPED)" tests/run-all.sh

# One pytest session, e.g. to debug with -x or --pdb: `make test-serial PYTEST_ARGS=-x`.
test-serial: lint
	$(BIN)/pytest -q $(PYTEST_ARGS)

unit: venv
	$(BIN)/pytest -q tests/unit

crd: venv
	$(BIN)/sgdjob crd > crds/sgdjobs.sgdjob.dev.yaml
	cp crds/sgdjobs.sgdjob.dev.yaml charts/sgdjob-operator/crds/
