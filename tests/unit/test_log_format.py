"""Structured log formats: trailing key=value pairs become fields, one event is one line."""

import json
import logging
import sys

import pytest

from kvstore.ops.logs import JsonFormatter, LogfmtFormatter, split_message


def record(message, *args, exc_info=None):
    return logging.LogRecord("kvstore.test", logging.INFO, __file__, 1, message, args, exc_info)


@pytest.mark.parametrize("message, event, fields", [
    ("draining complete open_leases_left=0 duration_s=0.257",
     "draining complete", {"open_leases_left": 0, "duration_s": 0.257}),
    ("namespace opened id=00ab model=llama tenant= page_bytes=65536",
     "namespace opened", {"id": "00ab", "model": "llama", "tenant": "", "page_bytes": 65536}),
    ("shm connection of pid=12 ended: reset", "shm connection of pid=12 ended: reset", {}),
    ("a=1 b=2", "a=1 b=2", {}),
])
def test_split_message(message, event, fields):
    assert split_message(message) == (event, fields)


def test_json_is_one_object_per_line_with_fields():
    try:
        raise ValueError("boom")
    except ValueError:
        line = JsonFormatter().format(record("commit failed pages=%d", 3, exc_info=sys.exc_info()))
    assert "\n" not in line
    document = json.loads(line)
    assert document["msg"] == "commit failed" and document["pages"] == 3 and document["level"] == "info"
    assert document["logger"] == "kvstore.test" and "ValueError: boom" in document["exc"]


def test_logfmt_quotes_what_needs_quoting():
    line = LogfmtFormatter().format(record("arena prefaulted bytes=%d model=%s", 4096, 'llama"3=x'))
    assert ' msg="arena prefaulted" bytes=4096 model="llama\\"3=x"' in line
    multi = LogfmtFormatter().format(record("cannot start: %s", "line one\nline two"))
    assert "\n" not in multi and multi.endswith('msg="cannot start: line one\\nline two"')


def test_fields_never_override_the_envelope():
    document = json.loads(JsonFormatter().format(record("odd level=evil ts=1")))
    assert document["level"] == "info" and document["ts"] != 1
