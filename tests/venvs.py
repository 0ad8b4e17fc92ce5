"""Virtual environments the compatibility tests build once and reuse, each with a stamp of what built it.

A stamp (`.stamp.json` in the environment) holds the inputs the environment was built from and what
the build found (versions, seconds, bytes). An environment whose stamp holds other inputs, or none, is
stale: `build` removes it and builds it again; `current` tells a test whether it may use it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
STAMP = ".stamp.json"


def python(venv: Path) -> Path:
    return venv / "bin" / "python"


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def current(venv: Path, inputs: dict) -> dict | None:
    """The stamp of `venv` when it was built from `inputs` and is still there, else None."""
    try:
        stamp = json.loads((venv / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return stamp if stamp.get("inputs") == inputs and python(venv).exists() else None


def build(venv: Path, inputs: dict, steps: Callable[[Path], dict]) -> dict:
    """The stamp of `venv`, building it first (fresh, from this interpreter's base Python) unless it is current.

    `steps(venv)` installs into the new environment and returns the facts to keep in the stamp."""
    stamp = current(venv, inputs)
    if stamp is not None:
        return stamp
    started = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(venv)])
    facts = steps(venv)
    stamp = {"inputs": inputs, **facts, "build_s": round(time.monotonic() - started, 1),
             "bytes": tree_bytes(venv)}
    (venv / STAMP).write_text(json.dumps(stamp, indent=1, sort_keys=True) + "\n")
    return stamp


def pip(venv: Path, *args: str) -> None:
    run([str(python(venv)), "-m", "pip", "--disable-pip-version-check", *args])


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a build step; a failure raises with the step's output."""
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PIP_PROGRESS_BAR": "off"},
                          **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}:\n{done.stdout[-4000:]}\n"
                           f"{done.stderr[-8000:]}")
    return done


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (links not followed)."""
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
