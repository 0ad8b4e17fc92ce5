# Two commands do all set-up on a fresh machine:
#   make run    virtualenv + install, then a kvstore node on the embedded default and a short client run
#   make test   virtualenv + install (with test extras), then the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ENGINES := $(VENV)/.engines

.PHONY: install run test bench bench-tcp proto clean

$(STAMP): pyproject.toml clients/python/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e "./clients/python[fast]" -e ".[test]"
	touch $@

install: $(STAMP)

# The engines the adapter tests run against, pinned, without their GPU dependency sets
# (see tests/requirements-engines.txt); test-only, never a dependency of the server.
$(ENGINES): $(STAMP) tests/requirements-engines.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -r tests/requirements-engines.txt
	touch $@

run: $(STAMP)
	$(BIN)/python examples/quickstart.py

test: $(STAMP) $(ENGINES)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	mkdir -p bench/results
	$(BIN)/python bench/shm_throughput.py --json bench/results/shm_throughput.json

bench-tcp: $(STAMP)
	mkdir -p bench/results
	$(BIN)/python bench/tcp_throughput.py --json bench/results/tcp_throughput.json

proto: $(STAMP)
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) *.egg-info clients/python/*.egg-info .pytest_cache
