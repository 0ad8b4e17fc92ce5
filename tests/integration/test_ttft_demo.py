"""The TTFT demo runs end to end on a tiny model: kvstore hits after round 1, identical answers, a plot."""

import subprocess
import sys
from pathlib import Path

# Not `from conftest import ROOT`: with tests/gpu/conftest.py collected first, `conftest` is that one.
ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_and_both_runs_agree(tmp_path):
    plot = tmp_path / "ttft.png"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ttft_demo.py"), "--clients", "2", "--rounds", "3",
         "--context-tokens", "128", "--question-tokens", "16", "--answer-tokens", "4", "--hidden", "128",
         "--layers", "2", "--vocab", "512", "--plot", str(plot)],
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "answers identical in both runs: yes" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit() and "%" in line]
    assert [row[0] for row in rows] == ["1", "2", "3"]
    assert rows[0][5] == "0%" and all(int(row[5].rstrip("%")) >= 80 for row in rows[1:])   # hit rate per round
    assert plot.stat().st_size > 1000
