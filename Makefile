# Two commands a new user needs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/june demo

# The gateway's browser test drives Debian's chromium, never a downloaded browser, and the README walkthrough types
# into tmux: install them as root when missing (without them those tests fail, saying what to install).
CHROMIUM ?= /usr/bin/chromium
# The suite mostly waits (on workers, leases, sweeps), so two pytest processes share the run, each with throwaway
# servers of its own, a whole file at a time (a module's workers stay in one process). PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2

test: $(STAMP)
	@[ -x $(CHROMIUM) ] || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || \
		{ echo "installing Debian's chromium for the browser test"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	@command -v tmux >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || \
		{ echo "installing tmux for the README walkthrough test"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux >/dev/null; }
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check june_wire june_worker producers tests bench
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/step_overhead.py
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
