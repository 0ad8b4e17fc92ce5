"""A node SIGKILLed while it copies pages into and out of a client's shared page buffer, again and again: every
page read afterwards is the one its key was put with, a put caught by a kill counts nothing that is not
stored, and a call caught by one fails as Unavailable (the node's half of a move never lands after the call)."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import threading
import time

import numpy as np
import pytest

from kvstore_client import AsyncKVStoreClient, KVStoreClient, Namespace, errors, native, shared_page_buffer

pytestmark = pytest.mark.skipif(native.copy_claimed is None, reason="kvstore_native is not installed")

PAGE = 256 << 10
# 4 MiB a chain: each get is a move the node takes part in, and so is each put's first Commit run (its last
# pipeline.TAIL_COMMIT_BYTES go alone: assisted_copy.MOVE_BYTES_MIN)
LENGTH = 16
NS = Namespace(model="shared-crash", page_bytes=PAGE)
KILLS = 5
RESTART_ERRORS = (errors.Unavailable, errors.Draining)


def page_of(key: str) -> np.ndarray:
    seed = hashlib.sha256(key.encode()).digest()
    return np.frombuffer((seed * (PAGE // len(seed)))[:PAGE], np.uint8)


def wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.02)


def served(call):
    """call()'s result, or None while the node restarts."""
    try:
        return call()
    except RESTART_ERRORS:
        return None


def restart(start_server, node, settings: dict):
    """A new node on the killed one's gRPC port and socket path."""
    return start_server({**settings, "server.grpc_address": node.address, "shm.socket_path": node.socket_path})


class Traffic(threading.Thread):
    """Puts chains from one shared buffer and reads chains into another, checking every page read."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.client = KVStoreClient(address, timeout_s=5)
        self.source = shared_page_buffer(LENGTH, PAGE)
        self.into = shared_page_buffer(LENGTH, PAGE)
        self.stored: list[list[str]] = []
        self.wrong: list[str] = []
        self.failures: list[BaseException] = []
        self.moves = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.stopping.is_set():
            n += 1
            keys = [f"chain{n}-{i}" for i in range(LENGTH)]
            try:
                for i, key in enumerate(keys):
                    self.source[i] = page_of(key)
                if self.client.put(NS, keys, self.source) == LENGTH:
                    self.stored.append(keys)
                for chain in (keys, self.stored[n % len(self.stored)] if self.stored else keys):
                    self.into[:] = 0
                    loaded = self.client.get(NS, chain, self.into)
                    self.wrong += [chain[i] for i in range(loaded)
                                   if not np.array_equal(self.into[i], page_of(chain[i]))]
                    self.moves += 1
            except RESTART_ERRORS:
                pass
            except BaseException as exc:  # reported by the test
                self.failures.append(exc)

    def finish(self) -> None:
        self.stopping.set()
        self.join(30)
        self.client.close()


def test_a_node_killed_mid_move_never_leaves_a_wrong_page(start_server, tmp_path):
    settings = {"nvme.enabled": "true", "nvme.paths": f"{tmp_path}/nvme", "nvme.map_bytes": "256MiB",
                "controller.write_policy": "write_through", "dram.arena_bytes": "128MiB"}
    node = start_server(settings)
    traffic = Traffic(node.address)
    traffic.start()
    try:
        for _ in range(KILLS):
            moves = traffic.moves
            wait_for(lambda: traffic.moves >= moves + 20, "traffic going on after a restart")
            node.process.send_signal(signal.SIGKILL)
            node.process.wait(10)
            node = restart(start_server, node, settings)
        moves = traffic.moves
        wait_for(lambda: traffic.moves >= moves + 20, "traffic going on after the last restart")
    finally:
        traffic.finish()
    assert traffic.failures == [], f"calls failed with other than a restart error: {traffic.failures[:3]}"
    assert traffic.wrong == [], f"pages read with the wrong bytes: {traffic.wrong[:5]}"
    with KVStoreClient(node.address) as client:   # what the last node holds is each chain's own bytes
        out = shared_page_buffer(LENGTH, PAGE)
        for keys in traffic.stored[-20:]:
            loaded = client.get(NS, keys, out, verify=True)
            assert all(np.array_equal(out[i], page_of(keys[i])) for i in range(loaded))


def test_a_node_killed_holding_a_moves_slots_makes_none_of_its_pages_visible(start_server, tmp_path):
    """The node dies with a put's slots held for its part of the copy: the put fails as Unavailable, and the
    restarted node serves none of those pages; the same put then stores them all."""
    settings = {"nvme.enabled": "true", "nvme.paths": f"{tmp_path}/nvme", "nvme.map_bytes": "256MiB",
                "controller.write_policy": "write_through"}
    node = start_server(settings, env={"KVSTORE_TESTING_FAILPOINTS": "move.before_copy=kill@2"})
    before, caught = [f"before-{i}" for i in range(LENGTH)], [f"caught-{i}" for i in range(LENGTH)]
    source = shared_page_buffer(LENGTH, PAGE)
    with KVStoreClient(node.address, timeout_s=5) as client:
        source[:] = np.stack([page_of(k) for k in before])
        assert client.put(NS, before, source) == LENGTH          # one move, then its short last run alone
        wait_for(lambda: next(t.pages for t in client.stats().tiers if t.tier == 3) >= LENGTH,
                 "the first put written through to NVMe")
        source[:] = np.stack([page_of(k) for k in caught])
        with pytest.raises(errors.Unavailable):
            client.put(NS, caught, source)                        # its first move kills the node
        node.process.wait(10)
        restart(start_server, node, settings)
        wait_for(lambda: served(lambda: client.lookup(NS, caught)) is not None, "the restarted node serving")
        assert client.lookup(NS, caught) == 0
        into = shared_page_buffer(LENGTH, PAGE)
        assert client.get(NS, before, into, verify=True) == LENGTH
        assert all(np.array_equal(into[i], page_of(k)) for i, k in enumerate(before))
        assert client.put(NS, caught, source) == LENGTH
        assert client.get(NS, caught, into, verify=True) == LENGTH
        assert all(np.array_equal(into[i], page_of(k)) for i, k in enumerate(caught))


def test_a_call_past_its_deadline_returns_only_once_the_node_is_done_with_its_buffer(start_server):
    """The node holds a get's slots for 2 s before it copies: the client copies every page itself meanwhile,
    its 0.5 s deadline passes, and the call raises DeadlineExceeded only after the node has answered (the node
    could otherwise still be writing into the caller's buffer), then the next call works."""
    node = start_server(env={"KVSTORE_TESTING_FAILPOINTS": "move.before_copy=sleep:2000"})
    keys = [f"slow-{i}" for i in range(LENGTH)]
    data = np.stack([page_of(k) for k in keys])
    with KVStoreClient(node.address, timeout_s=5) as client:
        assert client.put(NS, keys, data) == LENGTH               # from a plain buffer: no move
        into = shared_page_buffer(LENGTH, PAGE)
        started = time.monotonic()
        with pytest.raises(errors.DeadlineExceeded):
            client.get(NS, keys, into, timeout_s=0.5)
        assert time.monotonic() - started >= 1.9
        assert np.array_equal(into, data)                          # the client copied them all
        out = np.zeros_like(data)
        assert client.get(NS, keys, out) == LENGTH and np.array_equal(out, data)


def test_the_async_client_serves_other_tasks_while_the_node_holds_a_move(start_server):
    """The node holds each move's slots for 2 s before it copies. Meanwhile the event loop runs other tasks (the move
    waits for the node on a worker thread, not on the loop), and a get cancelled mid-move raises CancelledError only
    once the node has answered: until then the node may still write into the caller's buffer."""
    node = start_server(env={"KVSTORE_TESTING_FAILPOINTS": "move.before_copy=sleep:2000"})
    keys = [f"async-slow-{i}" for i in range(LENGTH)]
    data = np.stack([page_of(k) for k in keys])

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        async with AsyncKVStoreClient(node.address, timeout_s=10) as client:
            assert await client.put(NS, keys, data) == LENGTH                # from a plain buffer: no move
            ticker = asyncio.create_task(tick())
            into = shared_page_buffer(LENGTH, PAGE)
            assert await client.get(NS, keys, into) == LENGTH
            ticks_during_get = ticks
            cancelled = asyncio.create_task(client.get(NS, keys, shared_page_buffer(LENGTH, PAGE)))
            await asyncio.sleep(0.5)
            cancelled.cancel()
            cancelled_at = time.monotonic()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            waited = time.monotonic() - cancelled_at
            ticker.cancel()
            assert await client.get(NS, keys, np.zeros_like(data)) == LENGTH   # the client goes on
            return into, ticks_during_get, waited

    into, ticks_during_get, waited = asyncio.run(main())
    assert np.array_equal(into, data)
    assert ticks_during_get >= 10, ticks_during_get   # about 40 in 2 s; a loop held by the move ticks once at most
    assert waited >= 1.0, waited                      # the node answers about 1.5 s after the cancel
