"""The README's python code blocks run as written against a real server and a real cluster; only the addresses are
the test's."""

import re
import subprocess
import sys
from pathlib import Path

from cluster_parts import cluster_pool, etcd, start_node  # noqa: F401  (three nodes in a real etcd)

ROOT = Path(__file__).resolve().parents[2]

README_ADDRESS = "127.0.0.1:50051"
README_CLUSTER = "etcd://10.0.0.1:2379/prod"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)


def test_readme_python_blocks_run(server, cluster_pool):
    blocks = python_blocks()
    assert len(blocks) >= 3, "the README shows the client, the async client and one client for a cluster"
    assert any(README_CLUSTER in block for block in blocks)
    for block in blocks:
        assert README_ADDRESS in block
        runnable = block.replace(README_ADDRESS, server.address).replace(README_CLUSTER, cluster_pool.address)
        done = subprocess.run([sys.executable, "-c", runnable], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"README block failed:\n{block}\n{done.stderr}"
    assert subprocess.run([sys.executable, "-c", blocks[0].replace(README_ADDRESS, server.address)],
                          capture_output=True, text=True, timeout=120).stdout.split() == ["4", "''"]
