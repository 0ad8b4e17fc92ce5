"""Structure rules: generated code matches the .proto, imports point down, no print, env read in one place."""

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVER = ROOT / "kvstore"
CLIENT = ROOT / "clients" / "python" / "kvstore_client"


def python_files(*dirs):
    for d in dirs:
        yield from (p for p in d.rglob("*.py") if "proto" not in p.relative_to(d).parts)


def imported_modules(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_generated_modules_match_the_proto():
    sys.path.insert(0, str(ROOT / "proto"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    assert generate.drifted() == [], "run: python proto/generate.py"


@pytest.mark.parametrize("layer, forbidden", [
    ("tiers", ("kvstore.control", "kvstore.transport", "kvstore.server", "grpc")),
    ("transport", ("kvstore.control", "kvstore.tiers", "kvstore.server", "grpc")),
    ("control", ("kvstore.server", "kvstore.ops", "kvstore.admin")),
    ("ops", ("kvstore.server", "kvstore.admin")),
    # the admin CLI is a client of a running node: the wire contract and the SDK only
    ("admin", ("kvstore.server", "kvstore.control", "kvstore.tiers", "kvstore.transport", "kvstore.ops")),
])
def test_imports_point_down(layer, forbidden):
    for path in (SERVER / layer).rglob("*.py"):
        for module in imported_modules(path):
            assert not module.startswith(forbidden), f"{path.relative_to(ROOT)} imports {module}"


def test_client_sdk_never_imports_the_server():
    for path in python_files(CLIENT):
        for module in imported_modules(path):
            assert module != "kvstore" and not module.startswith("kvstore."), f"{path} imports {module}"


def test_no_print_and_environ_only_in_config():
    for path in python_files(SERVER, CLIENT):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                raise AssertionError(f"print() in {path.relative_to(ROOT)}: use logging")
            if isinstance(node, ast.Attribute) and node.attr == "environ":
                assert path == SERVER / "config.py", f"os.environ read in {path.relative_to(ROOT)}"
