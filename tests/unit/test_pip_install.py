"""`make test`'s installs (tests/pip_install.py) print no red pip resolver ERROR for the engines' GPU
dependencies left out on purpose, but one line saying so; other pip output and failures still show."""

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def wheel(directory: Path, name: str, requires: list[str]) -> Path:
    """A minimal wheel (metadata only): `name` 1.0 requiring `requires`."""
    path = directory / f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
    info = f"{name.replace('-', '_')}-1.0.dist-info"
    metadata = "Metadata-Version: 2.1\nName: " + name + "\nVersion: 1.0\n" + \
        "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{info}/METADATA", metadata)
        archive.writestr(f"{info}/WHEEL",
                         "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return path


def test_the_resolver_report_for_left_out_gpu_dependencies_is_one_line(tmp_path):
    venv.create(tmp_path / "venv", with_pip=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    engine = wheel(tmp_path, "gpu-engine", ["cuda-only-kernels==9.9", "plain-package"])
    plain = wheel(tmp_path, "plain-package", [])
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(engine)], check=True)
    # What plain pip prints for the next install: the red resolver report (the defect `make test` showed).
    raw = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", str(plain)], capture_output=True,
                         text=True)
    assert "ERROR: pip's dependency resolver" in raw.stderr and "cuda-only-kernels" in raw.stderr
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "plain-package"], check=True)
    done = subprocess.run([python, str(ROOT / "tests" / "pip_install.py"), "--no-index", str(plain)],
                          capture_output=True, text=True)
    assert done.returncode == 0
    assert "ERROR" not in done.stdout + done.stderr
    assert done.stdout.count("\n") == 1 and "left out on purpose" in done.stdout
    # A real failure is not hidden.
    failed = subprocess.run([python, str(ROOT / "tests" / "pip_install.py"), "--no-index", "no-such-package"],
                            capture_output=True, text=True)
    assert failed.returncode != 0 and "no-such-package" in failed.stderr
