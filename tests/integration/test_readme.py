"""The README's python code blocks run as written against a real server; only the address is the test's."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

README_ADDRESS = "127.0.0.1:50051"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)


def test_readme_python_blocks_run(server):
    blocks = python_blocks()
    assert len(blocks) >= 2, "the README shows the client and the async client"
    for block in blocks:
        assert README_ADDRESS in block
        done = subprocess.run([sys.executable, "-c", block.replace(README_ADDRESS, server.address)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"README block failed:\n{block}\n{done.stderr}"
    assert subprocess.run([sys.executable, "-c", blocks[0].replace(README_ADDRESS, server.address)],
                          capture_output=True, text=True, timeout=120).stdout.split() == ["4", "''"]
