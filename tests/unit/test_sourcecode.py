"""Structure: generated code current, imports point down and acyclic, no print, env read in config, no lock in the servicer."""

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
    """The node reads the environment in config.py only; the SDK in credentials.py only (KVSTORE_TOKEN, ...)."""
    for path in python_files(SERVER, CLIENT):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                raise AssertionError(f"print() in {path.relative_to(ROOT)}: use logging")
            if isinstance(node, ast.Attribute) and node.attr == "environ":
                assert path in (SERVER / "config.py", CLIENT / "credentials.py"), \
                    f"os.environ read in {path.relative_to(ROOT)}"


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_edges(path, modules):
    """(imported module, line) for every import in the file that names one of `modules`:
    those under `if TYPE_CHECKING:` and inside functions too, since a cycle there is still
    a cycle of design. `from a.b import c` is an edge to a.b, and to a.b.c when c is a module."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        yield from ((target, node.lineno) for target in targets if target in modules)


def strongly_connected(graph):
    """Tarjan's algorithm: the components of `graph` (node -> successors), each a list of nodes."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def shortest_cycle(graph, start, members):
    """A shortest path start -> ... -> start inside one component (breadth first)."""
    came_from, frontier = {}, [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node]):
                if successor not in members or successor in came_from:
                    continue
                came_from[successor] = node
                if successor == start:
                    path = [start]
                    while path[-1] != start or len(path) == 1:
                        path.append(came_from[path[-1]])
                    return path[::-1]
                following.append(successor)
        frontier = following
    raise AssertionError(f"{start} is in a component it cannot reach itself in")


def test_no_import_cycles_among_server_modules():
    paths = {module_name(path): path for path in SERVER.rglob("*.py")}
    lines = {}  # (importer, imported) -> first line
    for name, path in paths.items():
        for target, line in import_edges(path, paths):
            lines.setdefault((name, target), line)
    graph = {name: set() for name in paths}
    for importer, imported in lines:
        graph[importer].add(imported)
    cycles = []
    for component in strongly_connected(graph):
        if len(component) == 1 and component[0] not in graph[component[0]]:
            continue
        cycle = shortest_cycle(graph, min(component), set(component))
        steps = [f"{a} ({paths[a].relative_to(ROOT)}:{lines[a, b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
        cycles.append(f"{len(component)} modules {sorted(component)}, e.g.\n    " + "\n    ".join(steps))
    assert not cycles, "import cycles (TYPE_CHECKING and function-level imports count):\n  " + "\n  ".join(cycles)


def test_service_takes_no_lock_and_does_no_disk_io():
    # The store owns the lock and the disk; the servicer only translates requests to calls on it.
    path = SERVER / "control" / "service.py"
    for module in imported_modules(path):
        assert module.split(".")[0] not in ("threading", "lmdb", "os"), f"{path.relative_to(ROOT)} imports {module}"
    source = path.read_text()
    for needle in (".lock", "locked"):
        line = next((n for n, text in enumerate(source.splitlines(), 1) if needle in text), None)
        assert line is None, f"{path.relative_to(ROOT)}:{line} contains {needle!r}: the store owns the lock"
