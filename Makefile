# Set-up, demo and tests. Everything installs into .venv; torch is pinned to the CPU build that
# this machine carries on disk (pyproject.toml keeps torch>=2.4 open so users choose their build).
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
export KUBEBUILDER_ASSETS ?= $(shell ../shared/k8s/install.sh 2>/dev/null)

.PHONY: venv demo test test-split lint ruff unit crd
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

# As `lint` then pytest, but mypy (about a minute of one core on a cold cache) checks the types beside
# the test run, at nice 19; its verdict and output come at the end, and a type error fails the target.
test: ruff
	@nice -n 19 $(BIN)/mypy $(TYPED) > $(VENV)/mypy.log 2>&1 & types=$$!; \
	$(BIN)/pytest -q; tests=$$?; \
	wait $$types; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.log; \
	if [ $$typed -ne 0 ]; then echo "mypy found type errors (above)"; exit 1; fi; exit $$tests

# The same tests in two pytest sessions side by side (tests/run-all.sh): the real-node tests in the
# background, the rest in the foreground. 32-38 minutes in CI-like runs instead of 44-48, but in four
# runs the extra load exposed three timing races in tests (fixed); `test` stays one session until this
# has run green repeatedly.
test-split: ruff
	BIN=$(BIN) LOGS=$(VENV) TYPED="$(TYPED)" tests/run-all.sh

unit: venv
	$(BIN)/pytest -q tests/unit

crd: venv
	$(BIN)/sgdjob crd > crds/sgdjobs.sgdjob.dev.yaml
	cp crds/sgdjobs.sgdjob.dev.yaml charts/sgdjob-operator/crds/
