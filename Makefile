# Two commands on a fresh machine: `make run` (the main job on the default world) and `make test`.
# Both create the local virtualenv first. torch is pinned in pyproject.toml (a CPU wheel).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: run test test-all bench screenshots clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

# the MLproject's default entry point `main`, run by MLflow in this environment
run: $(VENV)/.installed
	PATH=$(abspath $(VENV))/bin:$$PATH mlflow run . --env-manager local --experiment-name rlhf_mlflow -P overwrite=true

test: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow"

test-all: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/train_rl_speed.py

# docs/ui-*.png from this checkout's store (after `make run`); needs Debian's chromium
screenshots: $(VENV)/.installed
	$(PY) scripts/screenshots.py

clean:
	rm -rf $(VENV) worlds mlruns mlflow.db
