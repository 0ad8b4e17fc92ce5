#!/bin/sh
# On a GPU machine, from the repository root: the GPU tests (tests/gpu), then the device script.
#   bench/gpu_check.sh [results_dir]        (default bench/results)
# Wheels in .whl/ (protobuf newer than the image's, and lmdb, grpcio-health-checking,
# grpcio-reflection for the tests that start a node) are installed first when present.
set -u
py=${PYTHON:-python3}      # the device image's python3 holds torch and cupy
out=${1:-bench/results}
mkdir -p "$out"
if [ -d .whl ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD:$PWD/clients/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
timeout 240 "$py" -m pytest -q -p no:cacheprovider -rs tests/gpu tests/unit/test_kv_layout_kernel_source.py 2>&1 \
    | tee "$out/gpu_tests.log"
timeout 300 "$py" bench/gpu_check.py --json "$out/gpu_check.json"
