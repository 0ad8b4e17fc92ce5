"""After its node restarts (SIGTERM or SIGKILL, then a new process on the same port and socket), a
client on every data plane (local or gRPC control over shared memory, TCP) serves again within 2 s
of the new node being ready; a call caught by the restart fails as Unavailable, a put caught by it
counts nothing, and no page read is ever wrong. The engines' adapters: test_client_reconnect_engines.py."""

from __future__ import annotations

import hashlib
import signal
import threading
import time

import numpy as np
import pytest

from kvstore_client import KVStoreClient, Namespace, errors

PAGE = 64 << 10
NS = Namespace(model="reconnect", page_bytes=PAGE)
CHAINS, LENGTH = 6, 4
# The product promise: a restarted node is served again this soon after it is ready.
SERVE_AGAIN_S = 2.0
# What a call caught by a restart may raise: the node stopped (Unavailable) or was draining.
RESTART_ERRORS = (errors.Unavailable, errors.Draining)
MODES = {"local": {"control": "local"}, "grpc": {"control": "grpc"}, "tcp": {"transport": "tcp"}}


def page_of(key: str | bytes, nbytes: int = PAGE) -> bytes:
    """A page's bytes derived from its key, so any page read can be checked on its own."""
    seed = hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def pages_of(keys: list[str]) -> np.ndarray:
    return np.stack([np.frombuffer(page_of(k), np.uint8) for k in keys])


def chain_keys(name: str) -> list[str]:
    return [f"{name}-{i}" for i in range(LENGTH)]


def node_settings(tmp_path) -> dict:
    # Pages are written down as they are committed, so they come back after a SIGKILL and a read
    # after the restart is served from the new node's arena, at offsets the old one used for others.
    return {"nvme.enabled": "true", "nvme.paths": f"{tmp_path}/nvme", "nvme.map_bytes": "256MiB",
            "controller.write_policy": "write_through", "server.drain_timeout_s": 5}


def wait_for(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def nvme_pages(client) -> int:
    return next(t.pages for t in client.stats().tiers if t.tier == 3)


def stop(server, how: str) -> None:
    if how == "SIGKILL":
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(10)
    else:
        assert server.terminate() == 0


def restart(start_server, first, settings):
    """A new node process on the first one's gRPC port and shm socket path."""
    return start_server({**settings, "server.grpc_address": first.address, "shm.socket_path": first.socket_path})


def first_success(action):
    """Seconds until `action` first succeeds (called in a loop, restart errors allowed), and its result."""
    ready = time.monotonic()
    while True:
        try:
            result = action()
            return time.monotonic() - ready, result
        except RESTART_ERRORS:
            assert time.monotonic() - ready < SERVE_AGAIN_S, "still failing after the node was ready"
            time.sleep(0.02)


class Traffic(threading.Thread):
    """Puts new chains and reads old and new ones with its own client, checking every page it reads."""

    def __init__(self, address: str, mode: dict, chains: list[list[str]]):
        super().__init__(daemon=True)
        self.client = KVStoreClient(address, timeout_s=5, **mode)
        self.chains = list(chains)
        self.wrong: list[str] = []
        self.failures: list[BaseException] = []
        self.reads_ok = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.stopping.is_set():
            n += 1
            keys = chain_keys(f"traffic{n}")
            try:
                if self.client.put(NS, keys, pages_of(keys)) == LENGTH:
                    self.chains.append(keys)
                for chain in (self.chains[-1], self.chains[n % len(self.chains)]):
                    out = np.zeros((LENGTH, PAGE), np.uint8)
                    loaded = self.client.get(NS, chain, out)
                    for i in range(loaded):
                        if out[i].tobytes() != page_of(chain[i]):
                            self.wrong.append(chain[i])
                    self.reads_ok += 1
            except RESTART_ERRORS:
                pass
            except BaseException as exc:  # reported by the test
                self.failures.append(exc)
            time.sleep(0.005)

    def finish(self) -> None:
        self.stopping.set()
        self.join(30)
        self.client.close()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_client_serves_again_after_its_node_restarts(start_server, tmp_path, mode, how):
    settings = node_settings(tmp_path)
    first = start_server(settings)
    chains = [chain_keys(f"c{c}") for c in range(CHAINS)]
    client = KVStoreClient(first.address, timeout_s=5, **MODES[mode])
    traffic = Traffic(first.address, MODES[mode], chains)
    try:
        transport = client.transport
        for keys in chains:
            assert client.put(NS, keys, pages_of(keys)) == LENGTH
        wait_for(lambda: nvme_pages(client) >= CHAINS * LENGTH)
        traffic.start()
        wait_for(lambda: traffic.reads_ok >= 10)
        stop(first, how)
        with pytest.raises(errors.Unavailable):  # the node is gone: a typed error, at once
            client.get(NS, chains[0], np.zeros((LENGTH, PAGE), np.uint8))
        second = restart(start_server, first, settings)

        # Read the chains last-written first, so the new node places them where the old one had others.
        out = np.zeros((LENGTH, PAGE), np.uint8)
        elapsed, loaded = first_success(lambda: client.get(NS, chains[-1], out))
        assert elapsed < SERVE_AGAIN_S
        assert loaded == LENGTH and np.array_equal(out, pages_of(chains[-1]))
        for keys in reversed(chains[:-1]):
            assert client.get(NS, keys, out, verify=True) == LENGTH and np.array_equal(out, pages_of(keys))
        fresh = chain_keys("after")
        assert client.put(NS, fresh, pages_of(fresh), verify=True) == LENGTH
        assert client.get(NS, fresh, out) == LENGTH and np.array_equal(out, pages_of(fresh))
        assert client.lookup(NS, fresh) == LENGTH and client.stats().pages_committed >= LENGTH
        assert client.transport == transport

        reads_before = traffic.reads_ok
        wait_for(lambda: traffic.reads_ok > reads_before + 10)  # the other client came back by itself too
        assert "recovery complete" in second.log()
    finally:
        traffic.finish()
        client.close()
    assert traffic.wrong == [], f"pages read with the wrong bytes: {traffic.wrong[:5]}"
    assert traffic.failures == [], f"calls failed with other than a restart error: {traffic.failures[:3]}"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_put_caught_by_a_crash_counts_nothing_and_the_next_one_is_stored(start_server, tmp_path, mode):
    """The node dies between a put's copy and its commit: the put fails (its slots were reserved, so it
    is not retried), nothing of it is served afterwards, and the same put on the new node stores it all."""
    settings = node_settings(tmp_path)
    first = start_server(settings, env={"KVSTORE_TESTING_FAILPOINTS": "commit.before_publish=kill@2"})
    before, caught = chain_keys("before"), chain_keys("caught")
    with KVStoreClient(first.address, timeout_s=5, **MODES[mode]) as client:
        assert client.put(NS, before, pages_of(before)) == LENGTH
        wait_for(lambda: nvme_pages(client) >= LENGTH)
        with pytest.raises(errors.Unavailable):
            client.put(NS, caught, pages_of(caught))     # the second commit kills the node
        first.process.wait(10)
        restart(start_server, first, settings)
        _, hits = first_success(lambda: client.lookup(NS, caught))
        assert hits == 0
        out = np.zeros((LENGTH, PAGE), np.uint8)
        assert client.get(NS, before, out, verify=True) == LENGTH and np.array_equal(out, pages_of(before))
        assert client.put(NS, caught, pages_of(caught)) == LENGTH
        assert client.get(NS, caught, out, verify=True) == LENGTH and np.array_equal(out, pages_of(caught))
