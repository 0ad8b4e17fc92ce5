#!/bin/sh
# On a GPU machine, from the repository root: the GPU tests (tests/gpu), then the device script.
#   bench/gpu_check.sh [results_dir]        (default bench/results)
# Wheels in .whl/ are installed first when present: the SDK's generated modules need protobuf at
# least the version they name, and the tests that start a node need lmdb, grpcio-health-checking
# and grpcio-reflection (with the grpcio they pin). Fetch them on a machine with pip for the
# device's Python (3.12) and carry .whl, e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     protobuf==7.36.2 lmdb==3.0.0 grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
# The device script's tier check starts a kvstore-server there too (it needs the same wheels and cupy).
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
