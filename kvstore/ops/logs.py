"""Structured logs: one line per event, as text, JSON or logfmt (ops.log_format).

Messages in kvstore are written as `what happened key=value key=value`; the JSON and
logfmt formats lift the trailing key=value pairs into fields, so a log pipeline can
filter on `duration_s` or `pages` without parsing prose. A traceback stays on the same
line (escaped), so one event is always one line.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

_PAIR = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(\S*)$")
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def configure(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    elif log_format == "logfmt":
        handler.setFormatter(LogfmtFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


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
    head = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "msg": event}
    for key, value in fields.items():
        head.setdefault(key, value)
    exc = ""
    if record.exc_info:
        exc = logging.Formatter().formatException(record.exc_info)
    return head, exc


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
        return " ".join(f"{key}={_logfmt_value(value)}" for key, value in line.items())


def _logfmt_value(value: Any) -> str:
    text = str(value)
    if text and not any(c in text for c in ' "=\\\n\t'):
        return text
    return json.dumps(text)  # quoted, with quotes, backslashes and newlines escaped
