"""The handoff example runs end to end on a tiny model: decode loads what prefill writes through a real cluster, and
both handoff modes give decode logits identical to its own prefill."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_handoff_example_runs_and_logits_are_identical(tmp_path):
    out = tmp_path / "handoff.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "pd_handoff.py"), "--tokens", "1024", "--hidden", "128",
         "--layers", "2", "--vocab", "512", "--chunk-tokens", "256", "--warmup-s", "5", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [r["mode"] for r in runs] == ["overlap", "after"]
    assert all(r["pages"] == 1024 // 64 and r["logits_identical"] and r["first_token_matches"] for r in runs)
