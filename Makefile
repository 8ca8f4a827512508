# Two commands for a newcomer: `make demo` and `make test`. Each creates .venv when
# missing and installs the pinned requirements once (a stamp keyed on their hash).
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
REQ_HASH := $(shell cat requirements.txt pyproject.toml | sha1sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(REQ_HASH)
export AIRFLOW_HOME := $(CURDIR)/airflow_home
export PATH := $(CURDIR)/$(BIN):$(PATH)
AIRFLOW_PORT ?= 8080

.PHONY: venv venv-node venv-node-vllm demo demo-stream demo-inputs system-deps test test-node test-node-vllm test-fast airflow airflow-stop bench clean-runs

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade "pip>=24"
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/pip check
	@rm -f $(VENV)/.installed-*; touch $@

demo: venv
	$(BIN)/python -m eagleflow.demo --config configs/local-demo.yaml

# The same demo streaming its hidden states through the run's Mooncake store, none on disk (docs/demo.md); the
# store's wheel needs Debian's libibverbs1 librdmacm1 libnuma1 (`make system-deps`).
demo-stream: venv
	$(BIN)/python -m eagleflow.demo --config configs/stream-demo.yaml

# The system packages the tests need (sshd, PostgreSQL, Redis, ip, docker-compose): installed with apt-get
# when run as root (as .ci/run does), otherwise `make test` stops at once and says what to install.
system-deps:
	@bash .ci/system-deps

# --durations: every run (and so every CI log) ends with the 40 slowest tests, so nobody has to guess where time goes.
# -n: pytest-xdist workers. Half of a serial run's wall time is waiting on servers, SSH and Airflow's parts, so
# two workers on 2 cores nearly halve it; every test uses free ports, its own temp dirs and process groups.
# `make test TEST_WORKERS=0` runs serially (in one process, as a debugger wants).
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist worksteal)
test: system-deps venv
	$(BIN)/python -m pytest tests -q -p no:cacheprovider $(XDIST) --ignore=tests/node --ignore=tests/node_vllm --durations=40 --durations-min=2 $(PYTEST_ARGS)

# The fast loop: unit tests only, none that starts Airflow's DB, a server or a model family (those are marked
# `slow` and run in `make test`); under 2 minutes on 2 cores.
test-fast: venv
	$(BIN)/python -m pytest tests/unit -q -p no:cacheprovider $(XDIST) -m "not slow" $(PYTEST_ARGS)

# The GPU node's environment (real sglang 0.5.23 with its CUDA torch, ~11 GB, ~5 min once):
# tests/node/ checks the capture hook, launcher flags and export against sglang's own classes on the CPU.
NODE_VENV := .venv-node
NODE_BIN := $(NODE_VENV)/bin
NODE_REQ_HASH := $(shell cat requirements-node.txt requirements-node-test.txt pyproject.toml | sha1sum | cut -c1-12)
NODE_STAMP := $(NODE_VENV)/.installed-$(NODE_REQ_HASH)

venv-node: $(NODE_STAMP)

$(NODE_STAMP): requirements-node.txt requirements-node-test.txt pyproject.toml
	@test -x $(NODE_BIN)/python || $(PY) -m venv $(NODE_VENV) || python3 -m venv $(NODE_VENV)
	$(NODE_BIN)/pip install -q --upgrade "pip>=24"
	$(NODE_BIN)/pip install -q -r requirements-node-test.txt
	$(NODE_BIN)/pip install -q --no-deps -e .
	@rm -f $(NODE_VENV)/.installed-*; touch $@

test-node: venv-node
	$(NODE_BIN)/python -m pytest tests/node -q -p no:cacheprovider --durations=15 --durations-min=2 $(PYTEST_ARGS)

# The vLLM node's environment (real vllm 0.33.0 and speculators 0.9.0 with vLLM's CUDA torch 2.14.0, ~10 GB, once):
# its own venv, since vLLM and sglang pin different torch and transformers. tests/node_vllm/ checks the
# speculators-format export against speculators' Eagle3Speculator and vLLM's config parsing and loader on the CPU.
NODE_VLLM_VENV := .venv-node-vllm
NODE_VLLM_BIN := $(NODE_VLLM_VENV)/bin
NODE_VLLM_REQ_HASH := $(shell cat requirements-node-vllm.txt requirements-node-vllm-test.txt pyproject.toml | sha1sum | cut -c1-12)
NODE_VLLM_STAMP := $(NODE_VLLM_VENV)/.installed-$(NODE_VLLM_REQ_HASH)

venv-node-vllm: $(NODE_VLLM_STAMP)

$(NODE_VLLM_STAMP): requirements-node-vllm.txt requirements-node-vllm-test.txt pyproject.toml
	@test -x $(NODE_VLLM_BIN)/python || $(PY) -m venv $(NODE_VLLM_VENV) || python3 -m venv $(NODE_VLLM_VENV)
	$(NODE_VLLM_BIN)/pip install -q --upgrade "pip>=24"
	$(NODE_VLLM_BIN)/pip install -q -r requirements-node-vllm-test.txt
	$(NODE_VLLM_BIN)/pip install -q --no-deps -e .
	$(NODE_VLLM_BIN)/pip check
	@rm -f $(NODE_VLLM_VENV)/.installed-*; touch $@

test-node-vllm: venv-node-vllm
	$(NODE_VLLM_BIN)/python -m pytest tests/node_vllm -q -p no:cacheprovider --durations=15 --durations-min=2 $(PYTEST_ARGS)

# The demo's inputs (sources, tokenizer, tiny Llama; built locally once), so `make airflow` works before `make demo`.
demo-inputs: venv
	$(BIN)/python -m eagleflow.demo_assets .cache/demo >/dev/null

airflow: venv demo-inputs
	$(BIN)/python -m eagleflow.airflow.deploy.standalone start --port $(AIRFLOW_PORT)

# stops Airflow's parts, then the node jobs its runs detached on this machine; KEEP_NODE_JOBS=1 lists them instead
airflow-stop:
	$(BIN)/python -m eagleflow.airflow.deploy.standalone stop $(if $(KEEP_NODE_JOBS),--keep-node-jobs)

bench: venv
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean-runs:
	rm -rf runs airflow_home/logs
