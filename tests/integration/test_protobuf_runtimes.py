"""The SDK's wire contract imports with no warning and its messages and pages round-trip byte for byte under
every protobuf from 5.29 to 7.x and numpy 1.x and 2.x: the SDK's lower bounds, the engines' resolutions, the newest.

Each row is a small virtualenv under .venv-compat/ (built once; its stamp names the pins, so a re-run
reuses it) holding only the SDK's four dependencies at the row's versions; the SDK itself comes from
this checkout (PYTHONPATH). tests/wire_contract_check.py runs in it against a node of this venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import venvs
import wire_contract_check

VENVS = venvs.ROOT / ".venv-compat"
RUNTIMES = {
    # every lower bound of clients/python/pyproject.toml (5.29.0 is yanked on PyPI but allowed by >=5.29)
    "floor": ["protobuf==5.29.0", "numpy==1.24.4", "grpcio==1.60.0", "xxhash==3.4.1"],
    # vLLM 0.33's protobuf floor; the last numpy 1.x
    "pb5.29.6-np1.26": ["protobuf==5.29.6", "numpy==1.26.4", "grpcio==1.70.0", "xxhash==3.5.0"],
    # the first 6.x: it warns on gencode one major older, and refuses older still
    "pb6.30.0-np2.0": ["protobuf==6.30.0", "numpy==2.0.2", "grpcio==1.71.0", "xxhash==3.5.0"],
    # what LMCache 0.5.6 resolves to (protobuf<7, numpy<=2.2.6, grpcio pinned by grpcio-observability)
    "pb6.33.6-np2.2": ["protobuf==6.33.6", "numpy==2.2.6", "grpcio==1.78.0", "xxhash==4.1.0"],
    "pb7.34.0-np2.3": ["protobuf==7.34.0", "numpy==2.3.5", "grpcio==1.80.0", "xxhash==4.1.0"],
    # what SGLang 0.5.23 and vLLM 0.33.0 resolve to, and the newest of each
    "newest": ["protobuf==7.36.2", "numpy==2.4.6", "grpcio==1.85.3", "xxhash==4.1.0"],
}


def runtime_venv(name: str) -> dict:
    """The row's venv, built unless its stamp holds these pins; returns the stamp."""
    pins = RUNTIMES[name]

    def install(venv) -> dict:
        venvs.pip(venv, "install", "--quiet", *pins)
        return {}

    return venvs.build(VENVS / name, {"pins": pins, "python": sys.version.split()[0]}, install)


def check(venv, *args: str, implementation: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(venvs.ROOT / "clients" / "python")}
    env.pop("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", None)
    if implementation:
        env["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = implementation
    script = venvs.ROOT / "tests" / "wire_contract_check.py"
    done = subprocess.run([str(venvs.python(venv)), str(script), *args], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def expected_messages():
    """The messages as this venv's protobuf serializes them."""
    return wire_contract_check.message_bytes()


@pytest.mark.parametrize("name", sorted(RUNTIMES))
def test_wire_contract_and_pages_under_runtime(name, server, expected_messages):
    venv = VENVS / name
    runtime_venv(name)
    pins = dict(pin.split("==") for pin in RUNTIMES[name])

    report = check(venv, "--address", server.address)
    assert report["versions"]["protobuf"] == pins["protobuf"]
    assert report["versions"]["numpy"] == pins["numpy"]
    assert report["versions"]["grpcio"] == pins["grpcio"]
    assert report["messages"] == expected_messages
    for page in report["pages"]:
        assert page["transport"] == "shm"
        assert page["keys_same_from_list"] and page["same_bytes"], page
        assert page["put"] == page["lookup_by_tokens"] == page["got"] == 2, page

    pure = check(venv, implementation="python")
    assert pure["versions"]["protobuf_implementation"] == "python"
    assert pure["messages"] == expected_messages
