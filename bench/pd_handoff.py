"""Prefill-to-decode handoff through a kvstore cluster, 8k- and 32k-token prompts.

    python bench/pd_handoff.py [--json bench/results/pd_handoff.json]

Runs examples/pd_handoff.py (read it for the setup: a real etcd, two nodes, a prefill and a
decode process, decode over TCP) for both prompt lengths and both modes in the same run:
  overlap  decode loads each segment as soon as it is committed (get with wait_ms);
  after    decode starts loading when prefill reports its last page (transfer after prefill).
The figure is the time from prefill's last page to decode holding every page. Placement is
not pinned (2 shared cores: prefill, decode and both nodes compete for them).
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else os.path.join(HERE, "results",
                                                                                           "pd_handoff.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    sys.exit(subprocess.call([sys.executable, os.path.join(HERE, "..", "examples", "pd_handoff.py"),
                              "--tokens", "8192,32768", "--runs", "overlap,after", "--json", out]))
