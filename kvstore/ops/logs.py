"""Structured logs: one line per event, as text, JSON or logfmt (ops.log_format).

Messages in kvstore are written as `what happened key=value key=value`; the JSON and
logfmt formats lift the trailing key=value pairs into fields, so a log pipeline can
filter on `duration_s` or `pages` without parsing prose; a structured value (the effective
configuration) is passed as `extra={"fields": {...}}` and stays structured. A traceback stays on
the same line (escaped), and so does any control character of a client's string, so one event
is always one line. With json or logfmt, what C libraries
write to stderr (gRPC core's own lines) is made structured too (kvstore/ops/stderr_lines.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from typing import Any

_PAIR = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(\S*)$")
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# Control characters as escapes: a newline in a client's string (a model name, a refused token)
# never starts a line of its own, so nobody forges a log line through kvstore.
_ESCAPES = {code: f"\\x{code:02x}" for code in (*range(32), 127)} | {10: "\\n", 13: "\\r", 9: "\\t"}


def configure(log_format: str, level: str) -> None:
    stream = sys.stderr if log_format == "text" else _structured_stderr(log_format)
    handler = logging.StreamHandler(stream)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    elif log_format == "logfmt":
        handler.setFormatter(LogfmtFormatter())
    else:
        handler.setFormatter(TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _structured_stderr(log_format: str):
    """Point fd 2 at a child that makes each line structured; the stream Python's own lines go to directly."""
    direct = os.dup(2)
    child = subprocess.Popen([sys.executable, "-m", "kvstore.ops.stderr_lines", log_format], stdin=subprocess.PIPE,
                             stdout=direct, close_fds=True)
    os.dup2(child.stdin.fileno(), 2)
    child.stdin.close()
    return os.fdopen(direct, "w", buffering=1, errors="backslashreplace")


def timestamp(created: float) -> str:
    """A record's time as every structured line gives it: 2026-12-02T03:09:47.848Z (UTC)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def split_message(message: str) -> tuple[str, dict[str, Any]]:
    """'draining complete open_leases_left=0 duration_s=0.2' -> ('draining complete', {...})."""
    words = message.split(" ")
    fields: dict[str, Any] = {}
    while words:
        match = _PAIR.match(words[-1])
        if match is None:
            break
        key, value = match.groups()
        fields.setdefault(key, float(value) if "." in value and _NUMBER.match(value) else
                          int(value) if _NUMBER.match(value) else value)
        words.pop()
    if not words:  # a message of pairs only keeps its text
        return message, {}
    return " ".join(words), dict(reversed(fields.items()))


def _base(record: logging.LogRecord) -> tuple[dict[str, Any], str]:
    event, fields = split_message(record.getMessage())
    head = {"ts": timestamp(record.created), "level": record.levelname.lower(), "logger": record.name, "msg": event}
    for key, value in fields.items():
        head.setdefault(key, value)
    for key, value in getattr(record, "fields", {}).items():
        head.setdefault(key, value)
    exc = ""
    if record.exc_info:
        exc = logging.Formatter().formatException(record.exc_info)
    return head, exc


class TextFormatter(logging.Formatter):
    """The text format, with a record's structured fields appended as key=<json>."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record).translate(_ESCAPES)
        extra = getattr(record, "fields", {})
        return line + "".join(f" {key}={json.dumps(value, sort_keys=True)}" for key, value in extra.items())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line, exc = _base(record)
        if exc:
            line["exc"] = exc
        return json.dumps(line, default=str)


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line, exc = _base(record)
        if exc:
            line["exc"] = exc
        return " ".join(f"{key}={logfmt_value(value)}" for key, value in line.items())


def logfmt_value(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)
    if text and not any(c in text for c in ' "=\\') and text.translate(_ESCAPES) == text:
        return text
    return json.dumps(text)  # quoted, with quotes, backslashes and control characters escaped
