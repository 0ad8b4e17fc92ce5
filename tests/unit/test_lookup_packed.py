"""Keys packed back to back in one field answer a Lookup exactly as the repeated field does, and a
packed request's size is checked (key length, whole keys, page count) before any key is looked up."""

from types import SimpleNamespace

import numpy as np
import pytest

from node_parts import ManualClock, close_node, drop_dram_copies, make_node, make_service, write_all_down
from kvstore_client import errors
from kvstore_client.keys import (Namespace, hex_digests, hex_digests_python, pack_keys, pack_keys_python,
                                 prefix_hashes_python)
from kvstore_client.lookup import PART_PAGES, PackedKeys, TokenChain, chain_keys, leading_hits, lookup_chain
from kvstore_client.node_steps import drive, take_on
from kvstore_client.proto import pb

PAGE = 8192
NODE = ["dram.arena_bytes=2MiB", "dram.slab_bytes=256KiB", "limits.batch_pages_max=64",
        "limits.lookup_pages_max=128", "nvme.map_bytes=64MiB", "controller.write_policy=write_through"]


@pytest.fixture
def node(tmp_path):
    svc = make_node(tmp_path, NODE)
    yield svc
    close_node(svc)


def open_ns(svc, **kw):
    spec = Namespace(model="m", page_bytes=PAGE, **kw).to_proto()
    return svc.open_namespace(pb.OpenNamespaceRequest(spec=spec), None).namespace_id


def put(svc, ns, keys, parent=b""):
    r = svc.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys, parent_key=parent, page_bytes=PAGE), None)
    for state, offset in zip(r.states, r.offsets):
        if state == pb.RESERVED:
            svc.store.arena.view[offset:offset + PAGE] = b"\x05" * PAGE
    svc.commit(pb.CommitRequest(lease_id=r.lease_id), None)


def chain(name, n):
    return [f"{name}-{i:04d}".encode() for i in range(n)]


def packed_request(ns, keys):
    return pb.LookupRequest(namespace_id=ns, keys_packed=b"".join(keys), key_bytes=len(keys[0]))


def test_packed_and_repeated_keys_get_the_same_pages_and_tiers(node):
    ns = open_ns(node)
    keys = chain("a", 40)
    put(node, ns, keys[:16])
    write_all_down(node)
    drop_dram_copies(node)                        # the first 16 pages on NVMe only
    put(node, ns, keys[16:30], parent=keys[15])   # the next 14 in DRAM (and on NVMe: write-through)
    for asked in (keys, keys[:16], keys[10:20], keys[30:], keys[:1]):
        repeated = node.handle("Lookup", pb.LookupRequest(namespace_id=ns, keys=asked))
        packed = node.handle("Lookup", packed_request(ns, asked))
        assert packed.hit_pages == repeated.hit_pages == len(packed.tiers_packed)
        assert list(packed.tiers_packed) == list(repeated.tiers) and not packed.tiers
    tiers = node.handle("Lookup", packed_request(ns, keys)).tiers_packed
    assert tiers == bytes([pb.NVME] * 16 + [pb.DRAM] * 14)


def test_a_packed_lookup_of_another_namespace_is_a_miss_or_not_found(node):
    ns, other = open_ns(node), open_ns(node, tenant="other")
    keys = chain("t", 8)
    put(node, ns, keys)
    assert node.handle("Lookup", packed_request(other, keys)).hit_pages == 0
    with pytest.raises(errors.NamespaceNotFound):
        node.handle("Lookup", packed_request(12345, keys))


@pytest.mark.parametrize("fields, error, message", [
    ({"keys_packed": b"x" * 64, "key_bytes": 0}, errors.InvalidArgument, "limits.key_bytes_max"),
    ({"keys_packed": b"x" * 130, "key_bytes": 65}, errors.InvalidArgument, "limits.key_bytes_max"),
    ({"keys_packed": b"x" * 65, "key_bytes": 8}, errors.InvalidArgument, "not a whole number of key_bytes=8"),
    ({"key_bytes": 8}, errors.InvalidArgument, "keys_packed is empty"),
    ({"keys_packed": b"x" * 8 * 129, "key_bytes": 8}, errors.BatchTooLarge, "limits.lookup_pages_max is 128"),
    ({"keys_packed": b"x" * 8, "key_bytes": 8, "keys": [b"k"]}, errors.InvalidArgument, "without keys"),
    ({"keys_packed": b"x" * 8, "key_bytes": 8, "tokens": [1]}, errors.InvalidArgument, "without keys"),
    ({"keys_packed": b"x" * 8, "key_bytes": 8, "parent_key": b"ab"}, errors.InvalidArgument, "without keys"),
    ({"keys_packed": b"x" * 64, "key_bytes": 64, "hex_digests": True}, errors.InvalidArgument, "key_bytes=32"),
    ({"keys": [b"k"], "hex_digests": True}, errors.InvalidArgument, "send the digests there"),
])
def test_a_packed_lookup_is_refused_by_its_size_before_any_key_is_read(fields, error, message):
    svc = make_service(["dram.arena_bytes=1MiB", "dram.slab_bytes=256KiB", "limits.batch_pages_max=64",
                        "limits.lookup_pages_max=128"], ManualClock())
    ns = open_ns(svc)
    # the store's index is gone: a request that reached it would fail with AttributeError, not `error`
    index, svc.store.index = svc.store.index, None
    with pytest.raises(error, match=message):
        svc.handle("Lookup", pb.LookupRequest(namespace_id=ns, **fields))
    svc.store.index = index
    most = pb.LookupRequest(namespace_id=ns, keys_packed=b"x" * 8 * 128, key_bytes=8)
    assert svc.handle("Lookup", most).hit_pages == 0
    assert svc.hello(pb.HelloRequest(), None).limits.lookup_keys_packed
    svc.store.arena.close()


def hex_chain(n, seed=0):
    return [key.encode() for key in prefix_hashes_python(np.arange(seed, seed + 4 * n, dtype=np.uint32), 4)]


def test_hex_keys_sent_as_digests_get_the_pages_and_tiers_of_their_digits(node):
    ns = open_ns(node)
    keys = hex_chain(40)
    put(node, ns, keys[:16])
    write_all_down(node)
    drop_dram_copies(node)                        # the first 16 pages on NVMe only
    put(node, ns, keys[16:30], parent=keys[15])
    for asked in (keys, keys[:16], keys[10:20], keys[30:], keys[:1]):
        digits = node.handle("Lookup", packed_request(ns, asked))
        digests = node.handle("Lookup", digests_request(ns, asked))
        assert digests.hit_pages == digits.hit_pages and digests.tiers_packed == digits.tiers_packed
        each = [node.handle("Lookup", pb.LookupRequest(each_key=True, **fields)).held
                for fields in (packed_fields(ns, asked), digests_fields(ns, asked))]
        assert each[0] == each[1] == bytes([pb.NVME] * 16 + [pb.DRAM] * 14 + [0] * 10)[keys.index(asked[0]):][:len(asked)]
    assert node.handle("Lookup", digests_request(ns, [keys[0].upper()])).hit_pages == 1   # the digest of either
    assert node.handle("Lookup", packed_request(ns, [keys[0].upper()])).hit_pages == 0    # another key


def packed_fields(ns, keys):
    return {"namespace_id": ns, "keys_packed": b"".join(keys), "key_bytes": len(keys[0])}


def digests_fields(ns, keys):
    return {"namespace_id": ns, "keys_packed": b"".join(bytes.fromhex(k.decode()) for k in keys), "key_bytes": 32,
            "hex_digests": True}


def digests_request(ns, keys):
    return pb.LookupRequest(**digests_fields(ns, keys))


@pytest.mark.parametrize("keys", [
    [b"0123456789abcdef" * 4, b"f" * 64, b"0" * 64],
    *[[b"0123456789abcdef" * 4, b"0" * at + bytes([c]) + b"0" * (63 - at)] for at in (0, 31, 32, 63) for c in b"AFg/:`\x80"],
    [b"0" * 63], [b"0" * 65], [b""], [b"0" * 32],
])
def test_hex_digests_takes_only_lowercase_hex_keys(keys):
    packed = b"".join(keys)
    expected = bytes.fromhex(packed.decode()) if all(set(k) <= set(b"0123456789abcdef") and len(k) == 64
                                                     for k in keys) else None
    if packed == b"":
        expected = b""
    assert hex_digests(packed) == expected == hex_digests_python(packed)


@pytest.mark.parametrize("digests_read", [True, False])
def test_a_node_that_reads_digests_is_sent_them_and_an_older_one_the_digits(node, digests_read):
    ns = open_ns(node)
    keys = hex_chain(200, seed=7)
    for start in range(0, 150, 50):
        put(node, ns, keys[start:start + 50], parent=keys[start - 1] if start else b"")
    limits = pb.Limits(lookup_pages_max=128, lookup_keys_packed=True, lookup_hex_digests=digests_read)
    control = _Node(node)
    assert control.drive(leading_hits(limits, ns, lookup_chain(Namespace("m", PAGE), keys, None))) == 150
    assert [(r.hex_digests, r.key_bytes) for r in control.sent] == [(digests_read, 32 if digests_read else 64)] * 2
    mixed = keys[:10] + [keys[10].upper()]   # an uppercase digit: not a digest's digits, sent as given
    control.sent.clear()
    assert control.drive(leading_hits(limits, ns, lookup_chain(Namespace("m", PAGE), mixed, None))) == 10
    assert [(r.hex_digests, r.key_bytes) for r in control.sent] == [(False, 64)]


@pytest.mark.parametrize("keys, expected", [
    (["ab", "cd", "ef"], (b"abcdef", 2)),
    ([b"ab", bytearray(b"cd"), memoryview(b"ef")], (b"abcdef", 2)),
    (("x" * 64,) * 3, (b"x" * 192, 64)),
    (["ab", "c", "def"], None),            # the right total from keys of different lengths
    (["ab", "cde"], None),
    (["ab", b"cd"], None),                 # str and bytes mixed
    (["é", "ab"], None),                   # non-ASCII: its UTF-8 is longer than its characters
    ([b"x" * 65] * 2, None),
    ([b"", b""], None),
    ([1, 2], None),
    (np.arange(4), None),                  # token ids where keys belong: encode_keys says so
    ([], None),
    ("abcd", None),
])
def test_pack_keys_packs_only_keys_of_one_length(keys, expected):
    assert pack_keys(keys) == expected == pack_keys_python(keys)


@pytest.mark.parametrize("part_pages", [1, 7, 50, 64])
def test_a_token_chain_hashed_in_parts_is_the_whole_chain(part_pages):
    ns = Namespace(model="m", page_bytes=PAGE, page_tokens=4, hash_seed="ab" * 32)
    tokens = list(range(4 * 50 + 3))
    chain = lookup_chain(ns, None, tokens)
    assert isinstance(chain, TokenChain) and len(chain) == 50
    parts = list(chain.parts(part_pages))
    assert [len(p) for p in parts] == [min(part_pages, 50 - i) for i in range(0, 50, part_pages)]
    expected = [key.encode() for key in prefix_hashes_python(tokens, 4, "ab" * 32)]
    assert [key for part in parts for key in part.unpacked()] == expected == chain_keys(ns, None, tokens)
    assert lookup_chain(ns, [b"a", b"bc"], None) == [b"a", b"bc"]   # mixed lengths: one by one
    assert isinstance(lookup_chain(ns, [b"ab", b"cd"], None), PackedKeys)
    with pytest.raises(errors.InvalidArgument, match="1 to 64 bytes"):
        lookup_chain(ns, [b"x" * 65], None)


class _Node:
    """The SDK's view of a control channel, over a real in-process service; keeps what was sent."""

    def __init__(self, svc):
        self.svc, self.sent = svc, []

    def call(self, name, request):
        self.sent.append(request)
        return self.svc.handle(name, request)

    def submit(self, name, request):
        answer = self.call(name, request)
        return type("Answered", (), {"result": lambda self: answer})()

    def drive(self, steps):
        return drive(steps, take_on(SimpleNamespace(control=self)))


@pytest.mark.parametrize("packed_node", [True, False])
def test_leading_hits_splits_a_long_chain_and_speaks_to_older_nodes(node, packed_node):
    ns = open_ns(node)
    keys = chain("p", 300)
    for start in range(0, 250, 50):
        put(node, ns, keys[start:start + 50], parent=keys[start - 1] if start else b"")
    limits = pb.Limits(lookup_pages_max=128, lookup_keys_packed=packed_node)
    control = _Node(node)
    assert control.drive(leading_hits(limits, ns, lookup_chain(Namespace("m", PAGE), keys, None))) == 250
    assert len(control.sent) == 3
    assert all(bool(r.keys_packed) == packed_node and bool(r.keys) != packed_node for r in control.sent)
    assert sum(len(r.keys) or len(r.keys_packed) // r.key_bytes for r in control.sent) == 300


def test_a_token_lookup_sends_each_part_hashed_from_the_last_key_of_the_one_before(node):
    spec = Namespace("m", PAGE, page_tokens=4)
    ns = open_ns(node, page_tokens=4)
    tokens = np.arange(4 * 300, dtype=np.uint32)
    keys = [key.encode() for key in prefix_hashes_python(tokens, 4)]
    for start in range(0, 250, 50):
        put(node, ns, keys[start:start + 50], parent=keys[start - 1] if start else b"")
    control = _Node(node)
    assert control.drive(leading_hits(pb.Limits(lookup_pages_max=128, lookup_keys_packed=True), ns,
                                      lookup_chain(spec, None, tokens))) == 250
    assert [r.keys_packed for r in control.sent] == [b"".join(keys[s:s + 128]) for s in (0, 128, 256)]


def test_a_chain_longer_than_a_part_goes_in_parts_where_the_node_would_take_it_whole():
    svc = make_service(["dram.arena_bytes=1MiB", "dram.slab_bytes=256KiB", "limits.batch_pages_max=64"], ManualClock())
    ns = open_ns(svc)
    keys = chain("w", 5000)
    put(svc, ns, keys[:40])
    control = _Node(svc)
    limits = svc.hello(pb.HelloRequest(), None).limits
    assert limits.lookup_pages_max > 5000
    assert control.drive(leading_hits(limits, ns, lookup_chain(Namespace("m", PAGE), keys, None))) == 40
    assert [len(r.keys_packed) // r.key_bytes for r in control.sent] == [PART_PAGES, PART_PAGES, 5000 - 2 * PART_PAGES]
    svc.store.arena.close()
