"""AsyncKVStoreClient against a real server: the sync client's answers and errors, many calls in flight on
one event loop with no thread per call, per-call deadlines that leave the channel in step, and pages over
the TCP data plane where shared memory cannot be used (another host, a tenant, a token-protected node)."""

import asyncio
import os
import signal
import time
import threading

import numpy as np
import pytest

from kvstore_client import AsyncKVStoreClient, InvalidArgument, KVStoreClient, Namespace, errors, node_steps, prefix_hashes
from kvstore_client.async_channel import AsyncTcpControlChannel

PAGE = 8192


@pytest.fixture
def ns():
    return Namespace(model="async", page_bytes=PAGE, page_tokens=16)


def pages(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8)


def test_same_answers_as_the_sync_client(server, ns):
    tokens = np.arange(16 * 40, dtype=np.int64)
    keys = prefix_hashes(tokens, 16)
    data = pages(40)

    async def run():
        async with AsyncKVStoreClient(server.address, timeout_s=10) as client:
            assert client.transport == "shm"
            stored = await client.put(ns, keys[:30], data[:30])
            assert stored == 30 and stored.complete
            assert await client.put(ns, keys[30:], data[30:], parent=keys[29]) == 10
            assert await client.lookup(ns, tokens=tokens) == 40
            assert (await client.route(ns, ["e"], tokens=tokens)).scores[0].prefix_pages == 40
            out = np.zeros_like(data)
            assert await client.get(ns, keys + ["missing"], np.zeros((41, PAGE), np.uint8)) == 40
            assert await client.get(ns, tokens=tokens, out=out, verify=True) == 40
            assert np.array_equal(out, data)
            assert (await client.stats()).pages_committed == 40
            assert await client.delete(ns, [keys[35]]) == 5
            assert await client.put(ns, ["orphan"], pages(1), parent="never-stored") == 0
            assert await client.put(ns, ["orphan"], pages(1), anchor="never-stored") == 1   # as the sync put
            assert await client.list_keys(ns) == sorted([k.encode() for k in keys[:35]] + [b"orphan"])
            await client.delete(ns, ["orphan"])
            return out

    asyncio.run(run())
    with KVStoreClient(server.address) as sync:   # what the async client stored, the sync one reads
        out = np.zeros((35, PAGE), np.uint8)
        assert sync.lookup(ns, keys) == 35 and sync.get(ns, keys[:35], out) == 35
        assert sync.list_keys(ns) == sorted(k.encode() for k in keys[:35])
        assert np.array_equal(out, data[:35])


def test_many_calls_in_flight_on_one_loop_without_threads(server, ns):
    async def run():
        async with AsyncKVStoreClient(server.address, timeout_s=10) as client:
            threads_before = threading.active_count()
            chains = [[f"chain{c}-{i}" for i in range(8)] for c in range(16)]
            results = await asyncio.gather(*(client.put(ns, chain, pages(8, seed=c))
                                             for c, chain in enumerate(chains)))
            assert results == [8] * 16
            outs = [np.zeros((8, PAGE), np.uint8) for _ in chains]
            loaded = await asyncio.gather(*(client.get(ns, chain, out) for chain, out in zip(chains, outs)))
            lookups = await asyncio.gather(*(client.lookup(ns, chain) for chain in chains))
            assert loaded == lookups == [8] * 16
            assert all(np.array_equal(out, pages(8, seed=c)) for c, out in enumerate(outs))
            assert threading.active_count() == threads_before

    asyncio.run(run())


def test_same_errors(server, ns):
    async def run():
        async with AsyncKVStoreClient(server.address) as client:
            with pytest.raises(InvalidArgument, match="prefix_hashes"):
                await client.put(ns, [1, 2], pages(2))
            with pytest.raises(InvalidArgument):
                await client.lookup(ns, tokens=np.ones((2, 2), np.int64))
            with pytest.raises(errors.PageSizeMismatch):
                await client.put(ns, ["a"], np.zeros((1, PAGE - 1), np.uint8))
            with pytest.raises(InvalidArgument):
                await client.get(ns, ["a"], np.zeros((1, PAGE), np.uint8), policy="soon")
            with pytest.raises(InvalidArgument, match="keys"):   # the server's answer, rebuilt as the same class
                await client.delete(ns, [])
            assert await client.lookup(ns, ["a"]) == 0

    asyncio.run(run())


@pytest.mark.timeout(60)
def test_per_call_timeout(start_server, ns):
    server = start_server()

    async def run():
        async with AsyncKVStoreClient(server.address, timeout_s=120) as client:
            assert await client.put(ns, ["t0"], pages(1)) == 1
            stop(server.process.pid)
            try:
                with pytest.raises(errors.DeadlineExceeded, match="timeout_s"):
                    await client.lookup(ns, ["t0"], timeout_s=0.3)
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            assert await client.lookup(ns, ["t0"], timeout_s=30) == 1   # the late answer was dropped in step
    asyncio.run(run())


def stop(pid):
    """SIGSTOP the node and wait until the kernel says it is stopped (the signal is delivered asynchronously)."""
    os.kill(pid, signal.SIGSTOP)
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.01)


def test_token_over_tls_on_another_host(start_server, tmp_path):
    """The async client speaks grpc.aio with the sync client's credentials; where pages cannot move through
    shared memory (transport="tcp" stands for another host) they move over TCP, the connection opened with
    the data ticket of alice's Hello."""
    from identities import Certificates, Tokens

    certs, tokens = Certificates(tmp_path), Tokens(tmp_path)
    node = start_server({"auth.tokens_file": str(tokens.path), "auth.tls_cert": certs.server_cert,
                         "auth.tls_key": certs.server_key})
    with KVStoreClient(node.address, token=tokens.alice, tls_ca=certs.ca, transport="tcp") as sync:
        assert sync.put(Namespace(model="tls", page_bytes=PAGE), ["k0"], pages(1)) == 1

    async def run():
        ns = Namespace(model="tls", page_bytes=PAGE)
        async with AsyncKVStoreClient(node.address, token=tokens.alice, tls_ca=certs.ca, transport="tcp") as alice:
            assert await alice.lookup(ns, ["k0"]) == 1
            assert alice.transport == "tcp"
            assert await alice.put(ns, ["k1"], pages(1, seed=1), parent="k0") == 1
            out = np.zeros((2, PAGE), np.uint8)
            assert await alice.get(ns, ["k0", "k1"], out) == 2
            assert np.array_equal(out, np.concatenate([pages(1), pages(1, seed=1)]))
        async with AsyncKVStoreClient(node.address, token=tokens.bob, tls_ca=certs.ca, transport="tcp") as bob:
            assert await bob.lookup(ns, ["k0"]) == 0     # another tenant's page is not there for bob
    asyncio.run(run())


def test_the_local_socket_gets_the_token_where_the_node_requires_one(start_server, tmp_path, ns):
    from identities import Tokens

    tokens = Tokens(tmp_path)
    node = start_server({"auth.tokens_file": str(tokens.path), "auth.local_uids": f"{os.getuid()}:ops:admin",
                         "auth.local_require_token": "true"})

    async def run():
        async with AsyncKVStoreClient(node.address, token=tokens.ops, timeout_s=10) as ops:
            assert ops.transport == "shm"
            assert await ops.put(ns, ["t0"], pages(1)) == 1 and await ops.lookup(ns, ["t0"]) == 1
    asyncio.run(run())


def test_a_restarted_node_is_connected_again(start_server, ns):
    """The node is SIGKILLed and started again at the same address: the next call notices the lost
    connection without a round trip, opens a new one (new arena, namespaces reopened) and works."""
    first = start_server()

    async def run():
        async with AsyncKVStoreClient(first.address, timeout_s=10) as client:
            assert await client.put(ns, ["r0"], pages(1)) == 1
            first.kill()
            start_server({"server.grpc_address": first.address, "shm.socket_path": first.socket_path})
            assert await client.lookup(ns, ["r0"]) == 0          # it was in DRAM only
            assert await client.put(ns, ["r1"], pages(1, seed=4)) == 1
            out = np.zeros((1, PAGE), np.uint8)
            assert await client.get(ns, ["r1"], out) == 1 and np.array_equal(out, pages(1, seed=4))
    asyncio.run(run())


def test_pages_over_tcp_come_back_byte_for_byte(start_server):
    """transport="tcp" keeps the client off shared memory, as on another host: put and get move over the TCP
    data plane (several Reserve batches, pages larger than one socket read), many calls at once on one loop."""
    server = start_server({"limits.batch_pages_max": 64})
    page = 64 << 10
    ns = Namespace(model="async-tcp", page_bytes=page)
    data = np.random.default_rng(9).integers(0, 256, (400, page), dtype=np.uint8)
    keys = [f"p{i}" for i in range(400)]

    async def run():
        async with AsyncKVStoreClient(server.address, transport="tcp", timeout_s=20) as client:
            assert client.transport == "tcp"
            assert isinstance(client._conn.control, AsyncTcpControlChannel)   # its calls beside its pages
            threads_before = threading.active_count()
            assert await client.put(ns, keys, data, verify=True) == 400
            out = np.zeros_like(data)
            assert await client.get(ns, keys + ["missing"], np.zeros((401, page), np.uint8)) == 400
            assert await client.get(ns, keys, out, verify=True) == 400
            assert np.array_equal(out, data)
            chains = [[f"c{c}-{i}" for i in range(4)] for c in range(8)]
            assert await asyncio.gather(*(client.put(ns, chain, data[4 * c:4 * c + 4])
                                          for c, chain in enumerate(chains))) == [4] * 8
            outs = [np.zeros((4, page), np.uint8) for _ in chains]
            assert await asyncio.gather(*(client.get(ns, chain, o) for chain, o in zip(chains, outs))) == [4] * 8
            assert all(np.array_equal(o, data[4 * c:4 * c + 4]) for c, o in enumerate(outs))
            assert threading.active_count() == threads_before
            # A get posts its Release without waiting for the answer: the node ends the lease soon after.
            deadline = time.monotonic() + 10
            while (await client.stats()).leases_open and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert (await client.stats()).leases_open == 0

    asyncio.run(run())
    with KVStoreClient(server.address) as sync:   # what went over TCP, shared memory reads back
        assert sync.transport == "shm"
        out = np.zeros_like(data)
        assert sync.get(ns, keys, out) == 400 and np.array_equal(out, data)


def test_a_local_tenant_moves_pages_over_its_own_memfd_or_tcp(start_server, tmp_path):
    """On the node's host a tenant uid maps its own tenant's memfd ("auto" picks shared memory); over TCP
    its connection opens with the HELLO of alice's data ticket; bob's ticket does not reach alice's pages."""
    from identities import Tokens

    tokens = Tokens(tmp_path)
    node = start_server({"auth.tokens_file": str(tokens.path), "auth.local_uids": f"{os.getuid()}:alice"})
    ns = Namespace(model="tenant-tcp", page_bytes=PAGE)
    data = pages(6, seed=5)

    async def run():
        async with AsyncKVStoreClient(node.address, token=tokens.alice) as alice:
            assert await alice.put(ns, [f"a{i}" for i in range(3)], data[:3]) == 3
            assert alice.transport == "shm"
        async with AsyncKVStoreClient(node.address, token=tokens.alice, transport="tcp") as alice:
            assert await alice.put(ns, [f"a{i}" for i in range(3, 6)], data[3:], parent="a2") == 3
            assert alice.transport == "tcp"
            out = np.zeros_like(data)
            assert await alice.get(ns, [f"a{i}" for i in range(6)], out, verify=True) == 6
            assert np.array_equal(out, data)
        async with AsyncKVStoreClient(node.address, token=tokens.alice) as alice:   # shared memory reads it back
            out = np.zeros_like(data)
            assert await alice.get(ns, [f"a{i}" for i in range(6)], out) == 6 and np.array_equal(out, data)
        async with AsyncKVStoreClient(node.address, token=tokens.bob) as bob:
            assert await bob.get(ns, ["a0"], np.zeros((1, PAGE), np.uint8)) == 0

    asyncio.run(run())


@pytest.mark.timeout(60)
def test_per_call_timeout_bounds_a_tcp_get(start_server, ns, monkeypatch):
    """The node stops (SIGSTOP) after it granted the pages and before their bytes move: the get fails with
    DeadlineExceeded after its timeout_s, not the client's; the next call opens a new data connection."""
    from kvstore_client.async_tcp_transport import AsyncTcpDataPath

    server = start_server()
    original = AsyncTcpDataPath.get

    async def stop_then_get(self, *args):
        stop(server.process.pid)
        return await original(self, *args)

    async def run():
        async with AsyncKVStoreClient(server.address, transport="tcp", timeout_s=120) as client:
            assert await client.put(ns, ["g0"], pages(1)) == 1
            monkeypatch.setattr(AsyncTcpDataPath, "get", stop_then_get)
            started = time.monotonic()
            try:
                with pytest.raises(errors.DeadlineExceeded, match="timeout_s"):
                    await client.get(ns, ["g0"], np.zeros((1, PAGE), np.uint8), timeout_s=1)
                elapsed = time.monotonic() - started
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            assert elapsed < 10
            monkeypatch.setattr(AsyncTcpDataPath, "get", original)
            out = np.zeros((1, PAGE), np.uint8)
            assert await client.get(ns, ["g0"], out, timeout_s=30) == 1 and np.array_equal(out, pages(1))
    asyncio.run(run())


def _recording(take_for, sent):
    """A shell's step-taker that also notes each message sent or posted and each page move, by kind."""
    def take_for_conn(conn):
        take = take_for(conn)

        def noted(step):
            if isinstance(step, (node_steps.Send, node_steps.Post)):
                sent.append((type(step).__name__, step.method, list(getattr(step.request, "keys", []))))
            elif isinstance(step, (node_steps.PutPages, node_steps.GetPages)):
                sent.append((type(step).__name__, len(step.pages)))
            return take(step)
        return noted
    return take_for_conn


def test_both_clients_send_the_same_messages_for_every_call(server, monkeypatch):
    """One core (node_calls.py) under two shells: the same calls send the same messages in the same order and
    move the same pages, whether blocking or awaited."""
    from kvstore_client import async_client, client as sync_client
    sync_sent, async_sent = [], []
    monkeypatch.setattr(sync_client, "take_on", _recording(node_steps.take_on, sync_sent))
    monkeypatch.setattr(async_client, "take_async_on", _recording(node_steps.take_async_on, async_sent))
    def script(ns_kv, ns_side, prefix):
        keys = [f"{prefix}-{i}" for i in range(640)]   # the first put long enough to go in several Commits
        return [("put", (ns_kv, keys[:600], pages(600)), {}),
                ("put", (ns_kv, keys[600:], pages(40)), {"parent": keys[599]}),
                ("lookup", (ns_kv, keys), {}), ("held", (ns_kv, keys[::7]), {}),
                ("get", (ns_kv, keys, np.zeros((640, PAGE), np.uint8)), {}),
                ("put_group", (keys[:4], [(ns_kv, pages(4)), (ns_side, pages(4))]), {}),
                ("get_group", ([(ns_kv, keys[:4], np.zeros((4, PAGE), np.uint8)),
                                (ns_side, keys[:4], np.zeros((4, PAGE), np.uint8))],), {}),
                ("list_keys", (ns_kv,), {}), ("delete", (ns_kv, keys[635:636]), {}), ("clear", (ns_side,), {})]

    def normalised(sent, prefix):
        """What was sent, the client's own key prefix taken out."""
        return [item[:2] + (tuple(key.replace(prefix.encode(), b"P-") for key in item[2]),) if len(item) == 3
                else item for item in sent]

    def spaces(who):
        return Namespace(model=f"parity-kv-{who}", page_bytes=PAGE), Namespace(model=f"parity-side-{who}",
                                                                              page_bytes=PAGE)

    with KVStoreClient(server.address) as client:
        sync_answers = [getattr(client, name)(*args, **kwargs) for name, args, kwargs in script(*spaces("s"), "s")]

    async def run():
        async with AsyncKVStoreClient(server.address) as client:
            return [await getattr(client, name)(*args, **kwargs) for name, args, kwargs in script(*spaces("a"), "a")]
    async_answers = asyncio.run(run())
    assert [str(a).replace("a-", "P-") for a in async_answers] == [str(a).replace("s-", "P-") for a in sync_answers]
    assert sync_answers[2] == 640 and sync_answers[4] == 640 and sync_answers[-2] == 5
    assert sum(item[1] == "Commit" for item in sync_sent) > 2
    assert normalised(async_sent, "a-") == normalised(sync_sent, "s-")
