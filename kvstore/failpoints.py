"""Named failpoints: the places where a crash of the node matters, armed only by tests.

Each name below marks one step of a page's life. Unarmed (always, in production), `hit`
is one lookup in an empty dict. A test arms points through the configuration
(`testing.failpoints`, or KVSTORE_TESTING_FAILPOINTS for a server it starts):

    commit.after_publish=kill@3            SIGKILL this process the 3rd time the point is reached
    writedown.before_lmdb_commit=kill%0.2  SIGKILL with probability 0.2 each time (seeded)
    promote.after_read=error@1             raise FailpointError once, the 1st time
    acquire.each_page=sleep:5              sleep 5 ms for each page an Acquire answers (a slow tier's stand-in)

Several specs are separated by commas. The crash tests (tests/fault/test_crash_failpoints.py)
kill the node at every point and check what a restart serves.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

NAMES = (
    "reserve.after_allocate",        # slots taken for a write lease, nothing written yet
    "commit.before_publish",         # slot bytes hashed, pages not yet visible
    "commit.after_publish",          # pages visible in DRAM, not yet on NVMe
    "writedown.before_lmdb_commit",  # a write-down transaction built, not committed
    "writedown.after_lmdb_commit",   # pages on NVMe, the index not yet told
    "promote.before_read",           # DRAM slots taken for NVMe pages, nothing read
    "promote.after_read",            # bytes read into the slots, not yet checked or published
    "evict.after_victims",           # DRAM or NVMe victims chosen and unlinked
    "delete.before_nvme",            # pages gone from the index, still on NVMe
    "recovery.after_scan",           # start-up: headers read, orphans not yet dropped
    "acquire.each_page",             # an Acquire's pages pinned, not yet answered (sleep: a slow tier)
    "hbm.before_publish",            # pages copied into the HBM pool, the copies not yet answered
    "move.before_copy",              # a shared buffer's move holds its slots, the node has copied none
)


class FailpointError(RuntimeError):
    """Raised by a point armed with `error`: a fault injected by a test."""


class _Armed:
    __slots__ = ("action", "countdown", "probability", "sleep_s")

    def __init__(self, action: str, countdown: int, probability: float, sleep_s: float = 0.0):
        self.action, self.countdown, self.probability, self.sleep_s = action, countdown, probability, sleep_s


_armed: dict[str, _Armed] = {}
_lock = threading.Lock()
_random = random.Random(0)


def arm(specs: str, seed: int = 0) -> None:
    """Arm points from `name=action@N` / `name=action%P` specs; raises ValueError naming a bad one."""
    global _random
    _armed.clear()
    _random = random.Random(seed)
    for spec in filter(None, (s.strip() for s in specs.split(","))):
        name, _, trigger = spec.partition("=")
        if name not in NAMES:
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(NAMES)}")
        if trigger.startswith("sleep:"):
            try:
                sleep_ms = float(trigger.removeprefix("sleep:"))
            except ValueError:
                sleep_ms = -1.0
            if not 0 < sleep_ms <= 10_000:
                raise ValueError(f"failpoint spec {spec!r}: want name=sleep:MS, MS in (0, 10000]")
            _armed[name] = _Armed("sleep", 0, 0.0, sleep_ms / 1000)
            continue
        action, at, count = trigger.partition("@")
        if at:
            armed = _Armed(action, int(count), 0.0)
        else:
            action, _, probability = trigger.partition("%")
            armed = _Armed(action, 0, float(probability))
        if action not in ("kill", "error") or (at and armed.countdown < 1) or (not at and not 0 < armed.probability <= 1):
            raise ValueError(f"failpoint spec {spec!r}: want name=kill@N, name=error@N, name=kill%P, name=error%P "
                             "or name=sleep:MS")
        _armed[name] = armed


def hit(name: str, times: int = 1) -> None:
    """Reached a failpoint (`times` over, for a point per page): do what it is armed with, if anything."""
    if not _armed:
        return
    assert name in NAMES, f"unregistered failpoint {name}"
    armed = _armed.get(name)
    if armed is None:
        return
    if armed.action == "sleep":
        time.sleep(armed.sleep_s * times)
        return
    with _lock:
        if armed.countdown:
            armed.countdown -= 1
            fire = armed.countdown == 0
        else:
            fire = armed.probability > 0 and _random.random() < armed.probability
    if not fire:
        return
    if armed.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise FailpointError(f"failpoint {name} fired")
