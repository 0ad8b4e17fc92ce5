"""`pip install` for `make test`, where the engines (sglang, lmcache, vllm) come without their GPU dependencies.

Those are left out on purpose (CUDA builds of torch, GPU kernels: gigabytes the storage paths under test never
import; see tests/requirements-engines.txt), so after any install pip's resolver lists every one of them under a
red "ERROR: pip's dependency resolver ...". That report is expected here: it is replaced by one line saying so.
Anything else pip prints goes through unchanged, and pip's exit status is returned.
"""

from __future__ import annotations

import re
import subprocess
import sys

RESOLVER_REPORT = "ERROR: pip's dependency resolver does not currently take into account"
UNMET = re.compile(r"^\S+ \S+ requires .*(which is not installed|which is incompatible)\.$")


def main(argv: list[str]) -> int:
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *argv],
                          capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    unmet = 0
    for line in done.stderr.splitlines():
        if line.startswith(RESOLVER_REPORT):
            continue
        if UNMET.match(line):
            unmet += 1
            continue
        print(line, file=sys.stderr)
    if unmet:
        print(f"pip: {unmet} requirements of the engines (CUDA torch, GPU kernels) are left out on purpose: "
              "the storage tests run them on CPU (tests/requirements-engines.txt)")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
