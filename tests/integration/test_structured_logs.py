"""A real node's log in the structured formats: every line parses, significant events carry
their durations and sizes, and page contents never reach the log, even at DEBUG."""

import json
import re

import numpy as np

from kvstore_client import KVStoreClient, Namespace

MARKER = b"PAGE-CONTENT-MUST-NOT-BE-LOGGED!"


def traffic(server):
    page = np.frombuffer(MARKER * (8192 // len(MARKER)), np.uint8)
    with KVStoreClient(server.address) as client:
        ns = Namespace(model="logs", page_bytes=8192)
        assert client.put(ns, ["a", "b"], np.stack([page, page])) == 2
        assert client.get(ns, ["a", "b"], np.zeros((2, 8192), np.uint8)) == 2
        client.delete(ns, ["a"])
    assert server.terminate() == 0


def test_json_lines(start_server):
    server = start_server({"ops.log_format": "json", "server.log_level": "DEBUG"})
    traffic(server)
    events = [json.loads(line) for line in server.log().splitlines()]
    by_msg = {e["msg"]: e for e in events}
    assert all({"ts", "level", "logger", "msg"} <= set(e) for e in events)
    assert by_msg["serving"]["startup_s"] >= 0 and by_msg["serving"]["arena_bytes"] == 64 << 20
    assert by_msg["arena prefaulted"]["bytes"] == 64 << 20 and "duration_ms" in by_msg["arena prefaulted"]
    assert by_msg["pages deleted"]["pages"] == 2
    assert by_msg["draining complete"]["open_leases_left"] == 0 and "duration_s" in by_msg["draining complete"]
    assert MARKER.decode() not in server.log()


def test_logfmt_lines(start_server):
    server = start_server({"ops.log_format": "logfmt", "server.log_level": "DEBUG"})
    traffic(server)
    lines = server.log().splitlines()
    pattern = re.compile(r'^ts=\S+ level=(debug|info|warning|error) logger=\S+ msg=("[^"]*"|\S+)( \w+=\S*)*')
    assert lines and all(pattern.match(line) for line in lines), lines
    assert any(line.startswith("ts=") and "msg=serving" in line and " startup_s=" in line for line in lines)
    assert MARKER.decode() not in server.log()


def test_json_on_every_line_with_grpc_cores_own_lines(start_server):
    """gRPC core writes to stderr itself (absl logging); those lines come out as JSON too, and the
    effective configuration is a field, not an escaped string."""
    server = start_server({"ops.log_format": "json"}, env={"GRPC_VERBOSITY": "debug"})
    traffic(server)
    events = [json.loads(line) for line in server.log().splitlines()]
    core = [e for e in events if e["logger"] == "grpc"]
    assert core and all(e["level"] in ("info", "warning", "error", "critical") and e["source"] for e in core)
    [configuration] = [e for e in events if e["msg"] == "effective configuration"]
    assert configuration["config"]["dram"]["arena_bytes"] == 64 << 20


def test_a_fatal_line_written_to_stderr_comes_out_structured(start_server):
    """What the interpreter writes to fd 2 as it dies (here: a line written straight to it, then SIGKILL)."""
    import os
    import signal
    import time

    server = start_server({"ops.log_format": "json"})
    with open(f"/proc/{server.process.pid}/fd/2", "w") as fd2:   # the node's own fd 2: the pipe
        fd2.write("Fatal Python error: a stand-in\n")
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(10)
    deadline = time.monotonic() + 10
    while "a stand-in" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    events = [json.loads(line) for line in server.log().splitlines()]
    assert {"logger": "stderr", "level": "error", "msg": "Fatal Python error: a stand-in"}.items() <= \
        [e for e in events if "stand-in" in e["msg"]][0].items()
