# Two commands do all set-up on a fresh machine:
#   make run    system packages + virtualenv + install, then the TTFT demo: a multi-turn chat on a small Llama,
#               recompute vs kvstore
#   make test   system packages + virtualenv + install (with test extras), then the whole test suite, then its
#               pure-Python pass
# System packages (deploy/system_packages.py): installed with apt-get when make runs as root, otherwise
# named in one line; what is missing then makes the native build fall back and its tests skip.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ENGINES := $(VENV)/.engines

.PHONY: install run quickstart test crash bench bench-hot-path bench-tcp proto clean system-packages system-packages-test \
	engine-envs

system-packages:
	@$(PYTHON) deploy/system_packages.py build

system-packages-test:
	@$(PYTHON) deploy/system_packages.py test

$(STAMP): pyproject.toml clients/python/pyproject.toml | system-packages
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
$(NATIVE): $(STAMP) native/setup.py native/pyproject.toml $(wildcard native/csrc/*) | system-packages
	@if $(BIN)/pip install --quiet --disable-pip-version-check ./native; then touch $@; else \
		echo "*** WARNING: kvstore_native did not build (see above). kvstore runs on its pure-Python paths," \
		     "several times slower. It needs a C compiler and Python's headers. ***" >&2; fi

install: $(STAMP) $(NATIVE)

# The engines the adapter tests run against, pinned, without their GPU dependency sets
# (see tests/requirements-engines.txt); test-only, never a dependency of the server.
$(ENGINES): $(STAMP) tests/requirements-engines.txt
	$(BIN)/python tests/pip_install.py --no-deps -r tests/requirements-engines.txt
	touch $@

run: system-packages $(STAMP) $(NATIVE)
	$(BIN)/python examples/ttft_demo.py

# The pure-Python pass: the tests of hashing, page copies and the page index again, with kvstore_native
# turned off in the tests and in every node they start (tests/without_native/kvstore_native.py).
FALLBACK_TESTS := tests/unit/test_keys.py tests/unit/test_index.py tests/unit/test_page_buffers.py \
	tests/unit/test_client_pipeline.py tests/unit/test_writer_checksums.py tests/unit/test_lookup_packed.py \
	tests/unit/test_service.py tests/unit/test_nvme_tier.py tests/unit/test_landing.py \
	tests/integration/test_put_get.py tests/integration/test_put_checksums.py \
	tests/integration/test_long_lookup.py tests/integration/test_nvme.py tests/integration/test_cli.py \
	tests/integration/test_startup_errors.py tests/integration/test_structured_logs.py \
	tests/integration/test_daemon.py tests/integration/test_native_core.py tests/integration/test_tcp_put_get.py

# One virtualenv per engine (SGLang, vLLM, LMCache): the engine's own resolved dependency set plus the SDK, less
# the CUDA torch and GPU kernels (tests/engine_envs.py lists them and why). Phony: the script checks what make
# cannot see (the resolution's inputs, pip and its config) and takes about 2 s when nothing changed.
engine-envs: $(STAMP)
	$(BIN)/python tests/engine_envs.py build

test: system-packages-test $(STAMP) $(NATIVE) $(ENGINES) $(VLLM_STAMP) engine-envs
	$(BIN)/python -m pytest -q
	PYTHONPATH=tests/without_native $(BIN)/python -m pytest -q $(FALLBACK_TESTS)

# The crash test's long form (tests/fault/test_crash_failpoints.py): at least 1000 SIGKILLs, at every
# named failpoint and at random points, each followed by a restart checked against the disk; prints
# the table and writes bench/results/crash_failpoints.json. About 40 minutes on two cores. Then the
# store's random runs against its model (tests/unit/test_store_properties.py), 50 times as many as in
# make test.
crash: $(STAMP) $(NATIVE)
	mkdir -p bench/results
	CRASH_KILLS=1000 CRASH_JSON=bench/results/crash_failpoints.json \
		$(BIN)/python -m pytest -q -s --timeout=0 tests/fault/test_crash_failpoints.py
	KVSTORE_PROPERTY_EXAMPLES=600 $(BIN)/python -m pytest -q --timeout=0 tests/unit/test_store_properties.py

quickstart: system-packages $(STAMP) $(NATIVE)
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
bench-tcp: $(STAMP) $(NATIVE)
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
	rm -rf $(VENV) .venv-engines .venv-compat *.egg-info clients/python/*.egg-info native/*.egg-info native/build .pytest_cache
