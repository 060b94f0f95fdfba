# The two fresh-machine commands (see README): `make demo` and `make test`.
PY ?= python3

.PHONY: setup test test-fast demo bench

setup:
	./scripts/setup.sh

test: setup
	$(PY) -m pytest -q

test-fast:
	$(PY) -m pytest -q -m "not slow and not oracle"

demo: setup
	$(PY) -m dflash_ir.demo

bench: setup
	$(PY) -m pytest bench -q
