"""The SDK as a new user tries it, against a real server: token ids in every form, misuse refused with the
SDK's own InvalidArgument before anything is stored, per-call deadlines honoured, a short put says why."""

import os
import signal
import time

import numpy as np
import pytest

from kvstore_client import InvalidArgument, KVStoreClient, Namespace, PutResult, errors, prefix_hashes
from kvstore_client.proto import pb

PAGE = 4096
PAGE_TOKENS = 16


@pytest.fixture
def ns():
    return Namespace(model="usability", page_bytes=PAGE, page_tokens=PAGE_TOKENS)


def pages(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8)


def test_integer_keys_are_refused_naming_the_fix(client, ns):
    with pytest.raises(InvalidArgument, match="prefix_hashes") as caught:
        client.put(ns, [1, 2, 3, 4], pages(4))
    assert isinstance(caught.value, ValueError)
    # bytes(3) would have been three zero bytes: nothing of the kind was stored.
    assert client.lookup(ns, [bytes(1)]) == 0 and client.lookup(ns, [bytes(3)]) == 0
    with pytest.raises(InvalidArgument):
        client.lookup(ns, keys=np.arange(4))
    with pytest.raises(InvalidArgument):
        client.get(ns, [7], np.zeros((1, PAGE), np.uint8))


@pytest.mark.parametrize("form", ["list", "numpy-int64", "numpy-uint32", "torch"])
def test_token_ids_in_every_form(client, ns, form):
    torch = pytest.importorskip("torch") if form == "torch" else None
    ids = list(range(1000, 1000 + 5 * PAGE_TOKENS + 3))          # five full pages and a partial one
    tokens = {"list": lambda: ids, "numpy-int64": lambda: np.array(ids, dtype=np.int64),
              "numpy-uint32": lambda: np.array(ids, dtype=np.uint32),
              "torch": lambda: torch.tensor(ids, dtype=torch.int64)}[form]()
    keys = prefix_hashes(tokens, PAGE_TOKENS)
    assert keys == prefix_hashes(ids, PAGE_TOKENS) and len(keys) == 5
    data = pages(5, seed=3)
    assert client.put(ns, tokens=tokens, buffers=data) == 5
    assert client.lookup(ns, tokens=tokens) == 5
    assert client.lookup(ns, keys) == 5
    assert client.route(ns, ["engine-a"], tokens=tokens).scores[0].prefix_pages == 5
    out = np.zeros_like(data)
    assert client.get(ns, tokens=tokens, out=out) == 5 and np.array_equal(out, data)


@pytest.mark.parametrize("bad_tokens", [[1.5, 2.5], np.ones((2, 16), np.int64), [-1, 3], [2 ** 63], [1, 2 ** 64], "hello", 7])
def test_bad_token_ids_are_invalid_argument(client, ns, bad_tokens):
    with pytest.raises(InvalidArgument):
        client.lookup(ns, tokens=bad_tokens)
    with pytest.raises(InvalidArgument):
        prefix_hashes(bad_tokens, PAGE_TOKENS)


def test_every_bad_argument_is_the_sdks_invalid_argument(client, ns, server):
    cases = [
        lambda: client.lookup(ns),                                           # neither keys nor tokens
        lambda: client.lookup(ns, keys=["a"], tokens=[1] * 16),              # both
        lambda: client.lookup(ns, keys="abc"),                               # a str is not a list of keys
        lambda: client.put(ns, ["a"], None),                                 # no pages
        lambda: client.put(ns, ["a"], [[1, 2, 3]]),                          # a page that is not a buffer
        lambda: client.put(ns, ["a"], pages(2)),                             # two pages for one key
        lambda: client.get(ns, ["a"], np.empty((1, PAGE // 8), object)),     # pointers, not page bytes
        lambda: client.put(ns, ["a"], np.empty((1, PAGE // 8), object)),
        lambda: client.get(ns, ["a"], np.zeros((1, PAGE), np.uint8), policy="soon"),
        lambda: client.lookup(ns, ["a"], timeout_s=-1),
        lambda: client.lookup(ns, ["a"], timeout_s="5"),                     # seconds as a number
        lambda: client.lookup(ns, ["a"], timeout_s=True),
        lambda: client.route(ns, "engine-a", keys=["a"]),                    # engine_ids is a list
        lambda: prefix_hashes([1] * 32, 0),
        lambda: KVStoreClient(server.address, control="udp"),
        lambda: KVStoreClient(server.address, timeout_s=0),
        lambda: KVStoreClient(server.address, timeout_s=True),
        lambda: KVStoreClient(server.address, spin_us=-1),
        lambda: KVStoreClient(server.address, spin_us=0.5),
        lambda: KVStoreClient(server.address, spin_us=10_001),
    ]
    for case in cases:
        with pytest.raises(InvalidArgument):
            case()
    closed = KVStoreClient(server.address)
    closed.close()
    with pytest.raises(InvalidArgument, match="closed"):
        closed.lookup(ns, ["a"])
    assert client.lookup(ns, ["a"]) == 0   # none of the above stored anything


@pytest.mark.timeout(60)
@pytest.mark.parametrize("control", ["local", "grpc"])
def test_per_call_timeout_is_honoured(server, ns, control):
    """The node is stopped (SIGSTOP): a call with timeout_s=0.3 fails with DeadlineExceeded naming its
    timeout, although the client's own timeout is 120 s; once the node runs again the client works."""
    with KVStoreClient(server.address, timeout_s=120, control=control) as client:
        client.put(ns, ["t0"], pages(1))
        stop(server.process.pid)
        try:
            with pytest.raises(errors.DeadlineExceeded, match="timeout_s"):
                client.lookup(ns, ["t0"], timeout_s=0.3)
            with pytest.raises(errors.DeadlineExceeded, match="timeout_s"):
                client.get(ns, ["t0"], np.zeros((1, PAGE), np.uint8), timeout_s=0.3)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert client.lookup(ns, ["t0"], timeout_s=30) == 1
        out = np.zeros((1, PAGE), np.uint8)
        assert client.get(ns, ["t0"], out) == 1 and np.array_equal(out, pages(1))


@pytest.mark.parametrize("spin_us", [0, 10_000])
def test_a_client_that_sleeps_at_once_or_polls_long_moves_the_same_pages(server, ns, spin_us):
    """spin_us changes only how a wait for the node's answer passes (polling, then asleep), never what moves."""
    data, keys = pages(600, seed=spin_us), [f"spin{spin_us}-{i}" for i in range(600)]
    with KVStoreClient(server.address, spin_us=spin_us) as client:
        assert client.put(ns, keys, data) == 600
        out = np.zeros_like(data)
        assert client.get(ns, keys, out) == 600 and np.array_equal(out, data)


def test_a_put_cut_short_by_a_full_node_says_why(start_server, ns):
    """All but two slots of a small arena are pinned by a read lease: a put of four pages stores two and
    says NO_SPACE; the count alone would look like a chain that simply ended."""
    server = start_server({"dram.arena_bytes": "1MiB", "dram.slab_bytes": "256KiB"})
    big = Namespace(model="usability-full", page_bytes=64 << 10, page_tokens=PAGE_TOKENS)
    data = np.ones((16, 64 << 10), np.uint8)
    with KVStoreClient(server.address, timeout_s=10) as client:
        result = client.put(big, [f"p{i}" for i in range(16)], data)
        assert isinstance(result, PutResult) and result == result.stored == 16 and result.complete
        assert result.reason == ""
        held = client._control.call("Acquire", pb.AcquireRequest(
            namespace_id=client._namespace_id(big), keys=[f"p{i}".encode() for i in range(14)]))
        assert held.hit_pages == 14
        short = client.put(big, [f"q{i}" for i in range(4)], data[:4])
        assert short == 2 and short.asked == 4 and not short.complete
        assert client.lookup(big, [f"q{i}" for i in range(4)]) == 2
        assert short.reason.startswith("NO_SPACE") and "full" in short.reason


def stop(pid):
    """SIGSTOP the node and wait until the kernel says it is stopped (the signal is delivered asynchronously)."""
    os.kill(pid, signal.SIGSTOP)
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.01)
