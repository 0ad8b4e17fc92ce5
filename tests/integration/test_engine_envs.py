"""kvstore-client resolves and installs with SGLang 0.5.23's, vLLM 0.33.0's and LMCache 0.5.6's own requirements,
and in each of those environments the SDK and its adapter import and pages round-trip through a real node byte for byte.

The environments are built by `python tests/engine_envs.py build` (make test runs it): resolution,
what is left out (CUDA torch, GPU kernels) and why are there. A missing or stale one fails the test
under CI=true and skips it elsewhere, saying what to run. Each test prints the protobuf, numpy and
grpcio its engine's resolution chose.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import engine_envs
import venvs
import wire_contract_check

# How far `import <engine>` gets on a CPU-only machine without LEFT_OUT: None = all the way. SGLang's
# __init__ imports triton (left out: 900 MB installed); its storage modules, which the adapter imports, do not.
TOP_LEVEL_IMPORT_ERROR = {"sglang": "ModuleNotFoundError: No module named 'triton'", "vllm": None, "lmcache": None}


@pytest.fixture(scope="module")
def expected_messages():
    return wire_contract_check.message_bytes()


def engine_stamp(engine: str) -> dict:
    stamp = engine_envs.stamp(engine)
    if stamp is None:
        reason = (f"the {engine} environment is missing or stale (.venv-engines/{engine}): "
                  f"run python tests/engine_envs.py build {engine}")
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return stamp


@pytest.mark.parametrize("engine", sorted(engine_envs.ENGINES))
def test_sdk_and_adapter_round_trip_pages_in_the_engines_environment(engine, start_server, expected_messages):
    stamp = engine_stamp(engine)
    server = start_server()
    resolved = stamp["resolved"]
    print(f"\n{engine}: resolution chose protobuf {resolved['protobuf']}, numpy {resolved['numpy']}, "
          f"grpcio {resolved['grpcio']}, xxhash {resolved['xxhash']}; left out {', '.join(stamp['left_out'])}")

    script = venvs.ROOT / "tests" / "engine_env_check.py"
    done = subprocess.run([str(venvs.python(engine_envs.VENVS / engine)), str(script), "--engine", engine,
                           "--adapter", engine_envs.ADAPTERS[engine], "--address", server.address],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-6000:]
    report = json.loads(done.stdout.splitlines()[-1])

    assert report["kvstore_client"].startswith(str(engine_envs.CLIENT)), "the SDK must be this checkout's"
    assert report["engine"]["version"] == engine_envs.ENGINES[engine].split("==")[1]
    assert report["engine"]["import"].get("error") == TOP_LEVEL_IMPORT_ERROR[engine], report["engine"]
    for package in ("protobuf", "numpy", "grpcio", "xxhash"):
        assert report["versions"][package] == resolved[package], package
    assert report["versions"]["torch"] == engine_envs.TORCH_CPU.split("==")[1]
    assert report["messages"] == expected_messages
    for page in report["pages"]:
        assert page["transport"] == "shm" and page["keys_same_from_list"] and page["same_bytes"], page
        assert page["put"] == page["lookup_by_tokens"] == page["got"] == 2, page
    assert report["torch_page"] == {"put": 2, "got": 2, "same_bytes": True}
