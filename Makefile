# Two commands do all set-up on a fresh machine:
#   make run    virtualenv + install, then the TTFT demo: a multi-turn chat on a small Llama, recompute vs kvstore
#   make test   virtualenv + install (with test extras), then the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ENGINES := $(VENV)/.engines

.PHONY: install run quickstart test crash bench bench-hot-path bench-tcp proto clean

$(STAMP): pyproject.toml clients/python/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python tests/pip_install.py -e "./clients/python[fast,cluster]" -e ".[test,events,demo,cluster]"
	touch $@

# vLLM's own KV-event classes and publisher for the event tests: vllm without its CUDA
# dependencies (it pins a CUDA torch), plus what vllm.distributed.kv_events imports.
VLLM_STAMP := $(VENV)/.vllm-installed
$(VLLM_STAMP): $(STAMP) tests/requirements-vllm-events.txt
	$(BIN)/python tests/pip_install.py --no-deps vllm==0.33.0
	$(BIN)/python tests/pip_install.py -r tests/requirements-vllm-events.txt
	touch $@

# kvstore_native (native/): the C hot loops. A failed build is loud and not fatal: the SDK and
# the server keep their pure-Python paths (same results, slower), and the next make tries again.
NATIVE := $(VENV)/.native-installed
$(NATIVE): $(STAMP) native/setup.py native/pyproject.toml $(wildcard native/csrc/*)
	@if $(BIN)/pip install --quiet --disable-pip-version-check ./native; then touch $@; else \
		echo "*** WARNING: kvstore_native did not build (see above). kvstore runs on its pure-Python paths," \
		     "several times slower. It needs gcc, Python headers, libssl-dev and libxxhash-dev. ***" >&2; fi

install: $(STAMP) $(NATIVE)

# The engines the adapter tests run against, pinned, without their GPU dependency sets
# (see tests/requirements-engines.txt); test-only, never a dependency of the server.
$(ENGINES): $(STAMP) tests/requirements-engines.txt
	$(BIN)/python tests/pip_install.py --no-deps -r tests/requirements-engines.txt
	touch $@

run: $(STAMP) $(NATIVE)
	$(BIN)/python examples/ttft_demo.py

test: $(STAMP) $(NATIVE) $(ENGINES) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q

# The crash test's long form (tests/fault/test_crash_failpoints.py): at least 1000 SIGKILLs, at every
# named failpoint and at random points, each followed by a restart checked against the disk; prints
# the table and writes bench/results/crash_failpoints.json. About 40 minutes on two cores.
crash: $(STAMP)
	mkdir -p bench/results
	CRASH_KILLS=1000 CRASH_JSON=bench/results/crash_failpoints.json \
		$(BIN)/python -m pytest -q -s --timeout=0 tests/fault/test_crash_failpoints.py

quickstart: $(STAMP)
	$(BIN)/python examples/quickstart.py

bench: $(STAMP) $(NATIVE)
	mkdir -p bench/results
	$(BIN)/python bench/shm_throughput.py --json bench/results/shm_throughput.json
	$(BIN)/python bench/full_cache_put.py --json bench/results/full_cache_put.json

# Put/get next to memmove and Mooncake Store's shared-memory path, lookups, prefix hashing
# (bench/hot_path.py), then node memory per indexed page and lookup latency by index (bench/index_memory.py).
# Mooncake is a peer in the comparison only; without it the bench says so and goes on.
MOONCAKE := mooncake-transfer-engine-non-cuda==0.3.13.post1
bench-hot-path: $(STAMP) $(NATIVE)
	mkdir -p bench/results
	-dpkg -s libibverbs1 librdmacm1 libnuma1 >/dev/null 2>&1 || \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 librdmacm1 libnuma1
	-$(BIN)/pip install --quiet --disable-pip-version-check $(MOONCAKE)
	$(BIN)/python bench/hot_path.py --json bench/results/hot_path.json
	$(BIN)/python bench/index_memory.py --json bench/results/index_memory.json

# TCP put/get next to a raw socket, Redis and Mooncake's Transfer Engine TCP path; a peer that
# cannot be installed is left out of the table with the reason printed.
bench-tcp: $(STAMP)
	mkdir -p bench/results
	-command -v redis-server >/dev/null || \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server
	-dpkg -s libibverbs1 librdmacm1 libnuma1 >/dev/null 2>&1 || \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 librdmacm1 libnuma1
	-$(BIN)/pip install --quiet --disable-pip-version-check $(MOONCAKE)
	$(BIN)/python bench/tcp_throughput.py --json bench/results/tcp_throughput.json

proto: $(STAMP)
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) *.egg-info clients/python/*.egg-info native/*.egg-info native/build .pytest_cache
