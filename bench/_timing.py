"""Timed round trips of one RPC for benchmarks (never collected by pytest)."""

from __future__ import annotations

import time


def call_times(channel, method: str, request, calls: int) -> list[float]:
    """Seconds each of `calls` back-to-back calls of `method` took on `channel`."""
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        channel.call(method, request)
        samples.append(time.perf_counter() - started)
    return samples
