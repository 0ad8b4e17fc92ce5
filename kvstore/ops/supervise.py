"""The serving loop of the daemon's main thread: proves the node alive to systemd, reports status.

WATCHDOG=1 goes out only after `problem()` came back empty in this very pass, so a node
whose service lock is stuck or whose lease reaper died stops pinging and systemd restarts
it (WatchdogSec=). STATUS= is refreshed every STATUS_INTERVAL_S. The loop ends at SIGTERM;
the drain that follows sends no WATCHDOG=1: systemd watches a running unit only, and a
stopping one is bounded by TimeoutStopSec= instead.

The loop wakes every POLL_S: a signal handler that sets `stop` does not wake a thread
blocked in Event.wait, so this bounds how long SIGTERM waits to start the drain.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvstore.ops.notify import Notifier

log = logging.getLogger(__name__)

POLL_S = 0.1
STATUS_INTERVAL_S = 10.0


def serve_until_stopped(stop: threading.Event, notifier: Notifier, problem: Callable[[], str],
                        status: Callable[[], str]) -> None:
    check_s = min(notifier.watchdog_interval_s or STATUS_INTERVAL_S, STATUS_INTERVAL_S)
    next_check = time.monotonic() + check_s
    next_status = time.monotonic() + STATUS_INTERVAL_S
    reported = ""
    while not stop.wait(POLL_S):
        now = time.monotonic()
        if now < next_check:
            continue
        next_check = now + check_s
        trouble = problem()
        if trouble:
            if trouble != reported:
                log.error("node unhealthy, watchdog withheld reason=%r", trouble)
                notifier.status(f"unhealthy: {trouble}")
                reported = trouble
            continue
        if reported:
            log.info("node healthy again")
            reported = ""
        if notifier.watchdog_usec:
            notifier.watchdog()
        if now >= next_status:
            notifier.status(status())
            next_status = now + STATUS_INTERVAL_S
