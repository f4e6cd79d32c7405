# `make demo`, `make proxy` and `make test` set up .venv on first use (Python >= 3.12, found by .ci/find-python).
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo proxy ui docs docs-build test test-fast test-slow bench bench-proxy bench-store bench-ui bench-engine bench-train bench-loop bench-trl

# Made where it really is (.ci/run may link .venv to its cache): a venv's scripts name its path.
$(PY): pyproject.toml
	venv="$$(realpath -m $(VENV))" && "$$(.ci/find-python)" -m venv "$$venv" \
	  && "$$venv/bin/python" -m pip install -q --upgrade pip && "$$venv/bin/python" -m pip install -q -e '.[test]'
	touch $(PY)

demo: $(PY)
	$(VENV)/bin/stepmill demo

proxy: $(PY)
	$(VENV)/bin/stepmill proxy

ui: $(PY)
	$(VENV)/bin/stepmill ui

# The documentation site (mkdocs.yml, docs/; the `docs` extra, part of `test`): served with live reload,
# or built into site/ with --strict, where a broken link, a missing anchor or a page left out of nav fails.
docs: $(PY)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

docs-build: $(PY)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The fast tests first, then the end-to-end ones (a real engine, cluster or trainer: marked slow); each
# pass ends with its slowest tests, so a CI log says where its time went.
test: test-fast test-slow

test-fast: $(PY)
	$(PY) -m pytest -q -m "not slow" --durations=15

test-slow: $(PY)
	$(PY) -m pytest -q -m slow --durations=30

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

# The trainer's benchmarks need torch: the engine venv's (.ci/install-engines), after the project's packages.
bench-train: $(PY)
	.ci/python-torch -m bench.train_bench

bench-loop: $(PY)
	.ci/python-torch -m bench.loop_bench

bench-trl: $(PY)
	.ci/python-torch -m bench.trl_compare
