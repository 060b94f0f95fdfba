# The two fresh-machine commands (see README): `make demo` and `make test`.
PY ?= python3

.PHONY: setup test test-fast demo bench bench-pytest train-demo fuzz

setup:
	./scripts/setup.sh

test: setup
	$(PY) -m pytest -q

test-fast:
	$(PY) -m pytest -q -m "not slow and not oracle"

demo: setup
	$(PY) -m dflash_ir.demo

# The backend comparison (see README): tables on screen, results.json / .md / PNGs in bench-results/.
bench: setup
	$(PY) -c "import llama_cpp" 2>/dev/null || eval "$$($(PY) -m dflash_ir.benchmark.peer --build-command)"
	dflash-bench -o bench-results

# The same measurements as pytest-benchmark cases (its statistics, --benchmark-json ...).
bench-pytest: setup
	$(PY) -m pytest bench -q -p no:cacheprovider

# The bounded fuzz campaign (see README): 100k executions each of the GGUF, artifact and tokenizer
# targets with atheris; corpora, logs and crashing inputs in build/fuzz/ (~15 min on 2 cores).
fuzz: setup
	$(PY) -m pip install -q -e ".[fuzz]"
	$(PY) -m dflash_ir.fuzzing campaign --runs 100000 --work build/fuzz

# Retrain the shipped demo pair (demo/*.gguf) from scratch, seeded; ~1 h on 2 CPU cores (see train/README.md).
train-demo:
	$(PY) -m pip install -e ".[train]"
	rm -rf build/demo-train
	nice -n 19 $(PY) -m train.run_all --work build/demo-train
