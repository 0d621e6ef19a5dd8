# fedbroker — two set-up commands: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
OUT    ?= out/demo

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## Replay the real Philly trace under all four policies on bundled real data, with the LP lower bound and the
## carbon-price sweep (the frontier plot in out/demo/report.html). --step 60 plans once a minute (the default is
## the live beat, 2 s: 2.7x the planner cycles and ~2x the CPU, cost 2 % lower; BENCHMARKS.md) to keep the demo short.
demo: $(STAMP)
	$(BIN)/fedbroker simulate --trace philly --policy fifo,backfill,cheapest,federated --step 60 --bound \
	    --sweep-carbon-price 0,190,1000,2000 --out $(OUT)

## Check the import rules (pyproject.toml [tool.importlinter]), then run the test suite.
test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_planner.py
	$(BIN)/python benchmarks/bench_simulator.py

clean:
	rm -rf $(VENV) out .pytest_cache
