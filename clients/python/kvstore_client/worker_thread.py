"""A blocking call awaited from asyncio on a worker thread, never abandoned while it may touch the caller's buffers."""

from __future__ import annotations

import asyncio
from typing import Any, Callable


async def to_the_end(call: Callable[[], Any]) -> Any:
    """call() on a worker thread, awaited; a cancelled await still waits for the thread to end (it may be copying
    into or out of the caller's buffers) before the cancellation goes on to the caller."""
    running = asyncio.get_running_loop().run_in_executor(None, call)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        while not running.done():
            try:
                await asyncio.shield(running)
            except asyncio.CancelledError:
                continue
            except Exception:   # the call failed after all: the caller asked for cancellation, it gets that
                break
        raise
