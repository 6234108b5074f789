# hvd_onebit: the two commands a newcomer runs are `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo bench clean

setup:
	@bash launch/setup.sh

# The whole suite: single-process and multi-rank tests. Bounded well inside CI's 90 minutes:
# every multi-rank launch carries its own timeout, and this is the outer guard.
test: setup
	timeout --signal=INT --kill-after=60 75m $(PY) -m pytest -q $(PYTEST_ARGS)

demo: setup
	$(PY) -m hvd_onebit_tools.bench.demo

bench: setup
	$(PY) -m hvd_onebit_tools.cli bench kernel
	$(PY) -m hvd_onebit_tools.cli bench allreduce

clean:
	rm -rf build *.egg-info hvd_onebit/*.so .pytest_cache
