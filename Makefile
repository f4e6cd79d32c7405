# `make demo`, `make proxy` and `make test` set up .venv on first use (Python >= 3.12, found by .ci/find-python).
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo proxy ui test bench bench-proxy bench-store bench-ui bench-engine

$(PY): pyproject.toml
	"$$(.ci/find-python)" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(PY)

demo: $(PY)
	$(VENV)/bin/stepmill demo

proxy: $(PY)
	$(VENV)/bin/stepmill proxy

ui: $(PY)
	$(VENV)/bin/stepmill ui

test: $(PY)
	$(PY) -m pytest -q

bench: $(PY)
	$(PY) -m bench.capture_bench

bench-proxy: $(PY)
	$(PY) -m bench.proxy_bench

bench-store: $(PY)
	$(PY) -m bench.store_bench

bench-ui: $(PY)
	$(PY) -m bench.ui_bench

bench-engine: $(PY)
	$(PY) -m bench.engine_bench
