# The README's commands. `make test` is all CI runs (.ci/run).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
export CONDUCTOR_TEST_DATABASE_URL ?= postgresql+psycopg://postgres@127.0.0.1:5432/conductor_test
export CONDUCTOR_TEST_BROKER_URL ?= redis://127.0.0.1:6379/5
export CONDUCTOR_TEST_RESULT_BACKEND ?= redis://127.0.0.1:6379/6

.PHONY: test lint unit integration services install demo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	@echo ">> installing conductor-queue and dev tools into $(VENV) (first run: about a minute)"
	$(BIN)/pip install --progress-bar on -e '.[dev]'
	@touch $@

install: $(STAMP)

services: $(STAMP)
	@bash scripts/ensure-services.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy conductor

test: services lint
	@echo ">> preparing the test database"
	$(BIN)/python scripts/prepare_test_db.py
	@echo ">> running the whole suite"
	$(BIN)/pytest -ra -p no:cacheprovider

unit: $(STAMP)
	$(BIN)/pytest -ra tests/unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
