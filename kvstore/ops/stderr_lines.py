"""What C libraries write to the node's stderr, as log lines in the node's format (ops.log_format json or logfmt).

gRPC core (absl logging), a fatal error of the interpreter, a library's warning: they write to
file descriptor 2 and never reach Python's logging. With a structured log format the node points
fd 2 at a pipe to this process, which writes each line on as one structured line
(`logger` "grpc" for absl's `E1202 03:09:47.848437 16629 file.cc:110] text` lines, "stderr"
otherwise). A process of its own, not a thread: it reads to the end of the pipe, so the last
lines a dying node writes (a SIGKILL, an abort) still come out. It ignores the signals that stop
the node (a terminal's Ctrl-C, systemd's SIGTERM to the whole unit) and ends at end of file.

    python -m kvstore.ops.stderr_lines json|logfmt    # reads stdin, writes stdout
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time

from kvstore.ops.logs import logfmt_value, timestamp

_ABSL = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ (\S+)\] (.*)$")
_LEVELS = {"I": "info", "W": "warning", "E": "error", "F": "critical"}


def structured(line: str) -> dict[str, str]:
    head = {"ts": timestamp(time.time())}
    match = _ABSL.match(line)
    if match:
        return {**head, "level": _LEVELS[match[1]], "logger": "grpc", "msg": match[3], "source": match[2]}
    return {**head, "level": "error", "logger": "stderr", "msg": line}


def render(fields: dict[str, str], log_format: str) -> str:
    if log_format == "json":
        return json.dumps(fields)
    return " ".join(f"{key}={logfmt_value(value)}" for key, value in fields.items())


def main(log_format: str) -> int:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    for raw in sys.stdin.buffer:
        line = raw.decode(errors="replace").rstrip("\n")
        if not line:
            continue
        if line.startswith("{") and log_format == "json":   # already one of ours
            sys.stdout.write(line + "\n")
        else:
            sys.stdout.write(render(structured(line), log_format) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
