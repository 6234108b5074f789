# hvd_onebit: the two commands a newcomer runs are `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo bench docs tables install-check clean

setup:
	@bash launch/setup.sh

# The whole suite: single-process and multi-rank tests. Bounded well inside CI's 90 minutes:
# every multi-rank launch carries its own timeout, and this is the outer guard.
test: setup
	timeout --signal=INT --kill-after=60 75m $(PY) -m pytest -q $(PYTEST_ARGS)

demo: setup
	$(PY) -m hvd_onebit_tools.bench.demo

bench: setup
	$(PY) -m hvd_onebit_tools.cli bench dev kernel
	$(PY) -m hvd_onebit_tools.cli bench allreduce

# The documentation site (docs/), warnings as errors; tests/test_docs.py builds it too. It needs
# only torch and `pip install ".[docs]"` (the development venv when there is one, else python3).
# `make tables` regenerates the pages' tables from the benchmarks' JSON (tests/test_docs.py fails
# when one is stale).
DOCS_PY := $(if $(wildcard $(PY)),$(PY),python3)
docs:
	$(DOCS_PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

tables: setup
	$(PY) -m hvd_onebit_tools.docs_tables

# pip install from an sdist into a second venv holding torch and Horovod, then an example there
# (several minutes: it installs torch; prints one JSON line).
install-check: setup
	bash launch/install_check.sh

clean:
	rm -rf build *.egg-info hvd_onebit/*.so .pytest_cache docs/_build
