"""Prefix hashes are byte-identical to SGLang's get_hash_str chain, and namespaces are stable ids."""

import hashlib

import numpy as np
import pytest

from kvstore_client import native
from kvstore_client.arguments import keys_or_tokens
from kvstore_client.errors import InvalidArgument
from kvstore_client.tokens import token_array
from kvstore_client.keys import (Namespace, encode_key, encode_keys, namespace_id, page_hash, prefix_hashes,
                                 prefix_hashes_packed, prefix_hashes_python, salt_seed)


def reference_get_hash_str(token_ids, prior_hash=None):
    """SGLang's algorithm (sglang/srt/mem_cache/cpp_utils/hash_binding.cpp, behind get_hash_str), written
    out: uint32 LE per token, or, where a token is past uint32, 0xff and uint64 LE per token."""
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    wide = any(t > 0xFFFFFFFF for t in token_ids)
    if wide:
        hasher.update(b"\xff")
    for t in token_ids:
        hasher.update(t.to_bytes(8 if wide else 4, byteorder="little", signed=False))
    return hasher.hexdigest()


def reference_chain(tokens, page, seed=None):
    keys, prior = [], seed
    for start in range(0, len(tokens) - page + 1, page):
        prior = reference_get_hash_str(tokens[start:start + page], prior)
        keys.append(prior)
    return keys


def test_single_page_matches_a_fixed_vector():
    # sha256 of the little-endian uint32 bytes of 1, 2, 3, 4: computed once with the algorithm above
    expected = hashlib.sha256(b"\x01\0\0\0\x02\0\0\0\x03\0\0\0\x04\0\0\0").hexdigest()
    assert page_hash([1, 2, 3, 4]) == expected == reference_get_hash_str([1, 2, 3, 4])


@pytest.mark.parametrize("page", [1, 16, 64])
def test_chain_matches_reference(page):
    rng = np.random.default_rng(page)
    tokens = rng.integers(0, 2**32 - 1, size=page * 9 + 3, dtype=np.uint64).tolist()
    assert prefix_hashes(tokens, page) == reference_chain(tokens, page)
    assert prefix_hashes(np.array(tokens, dtype=np.uint32), page) == reference_chain(tokens, page)


def test_seed_is_the_prior_of_the_first_page():
    seed = hashlib.sha256(b"tenant-salt").hexdigest()
    tokens = list(range(40))
    assert prefix_hashes(tokens, 8, seed=seed) == reference_chain(tokens, 8, seed)
    assert prefix_hashes(tokens, 8, seed=seed) != prefix_hashes(tokens, 8)


def test_a_key_names_its_whole_prefix():
    a = prefix_hashes([1, 2, 3, 4, 5, 6], 2)
    b = prefix_hashes([9, 9, 3, 4, 5, 6], 2)
    assert a[1:] != b[1:]  # same page tokens, different prefix -> different keys


def test_partial_trailing_page_gets_no_key():
    assert len(prefix_hashes(list(range(17)), 8)) == 2


# Digests SGLang 0.5.23's own get_hash_str gave (tests/integration/test_sglang_keys.py checks the rest live).
SGLANG_VECTORS = [
    ([1, 2, 3, 4], "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"),
    ([2**32], "51e2a39324194d5161469fa264a9384235bfab266722e69a80a15cd932185a33"),
    ([2**40 + 5, 3], "1b0298d277e5f4bb1dca0748055ae2a238279f0d8747fbe12bc6d87b69d539c0"),
    ([2**63 - 1], "dabcf736814b4d5bbc4d2ad596423df000c507308a6c57ce351f33e8d7ecf23a"),
]

WIDE = [3, 2**32, 7, 2**40 + 5, 11, 2**62 - 1, 2**63 - 1, 0xFFFFFFFF, 5, 6, 7, 8]   # pages of 2: narrow ones too


@pytest.mark.parametrize("tokens, digest", SGLANG_VECTORS)
def test_a_page_hashes_as_sglang_hashes_it_narrow_or_wide(tokens, digest):
    """2**40 + 5 is hashed whole, never as 5: SGLang's multimodal pad values are up to 62 bits."""
    assert page_hash(tokens) == digest == reference_get_hash_str(tokens)
    assert page_hash(np.array(tokens, np.int64)) == page_hash(np.array(tokens, np.uint64)) == digest
    assert prefix_hashes(tokens, len(tokens)) == [digest]
    assert prefix_hashes(np.array(tokens, np.int64), len(tokens)) == [digest]
    assert page_hash([5]) != page_hash([2**40 + 5])


@pytest.mark.parametrize("page", [1, 2, 3, 12])
def test_a_chain_with_wide_ids_matches_sglangs_from_every_form(page):
    want = reference_chain(WIDE, page)
    assert prefix_hashes(WIDE, page) == prefix_hashes_python(WIDE, page) == want
    for dtype in (np.int64, np.uint64):
        assert prefix_hashes(np.array(WIDE, dtype), page) == want
    assert prefix_hashes_packed(np.array(WIDE, np.int64), page) == "".join(want).encode()
    seed = hashlib.sha256(b"salt").hexdigest()
    assert prefix_hashes(WIDE, page, seed) == prefix_hashes_python(WIDE, page, seed) == reference_chain(WIDE, page, seed)


@pytest.mark.parametrize("ids", [[-1], np.array([-1], np.int64), np.array([-1], np.int32), [2**63],
                                 np.array([2**63], np.uint64), [2**64], [-1, 2**63], [1, 2**70]])
def test_token_ids_sglang_cannot_hash_are_refused(ids):
    """Negative ids and ids past int64's maximum: SGLang refuses them too."""
    for hash_them in (lambda: prefix_hashes(ids, 1), lambda: prefix_hashes_python(ids, 1),
                      lambda: prefix_hashes_packed(ids, 1), lambda: page_hash(ids)):
        with pytest.raises(InvalidArgument, match="0 to 9223372036854775807"):
            hash_them()


@pytest.mark.skipif(not native.available(), reason="kvstore_native is not built")
def test_the_native_chain_refuses_what_sglang_refuses_even_unchecked():
    """The C chain's own range check, under token_array's."""
    for ids in (np.array([1, -1], np.int64), np.array([2**63], np.uint64), np.array([-2], np.int32)):
        with pytest.raises(ValueError, match="2\\*\\*63-1"):
            native.module.prefix_hashes(ids, 1, b"")


def test_ids_past_uint32_never_travel_in_a_uint32_tokens_field():
    """A Route by tokens sends them for the node to hash in a uint32 field: a wide id is refused
    there with what to pass instead, never cut to 32 bits."""
    assert keys_or_tokens(None, [1, 0xFFFFFFFF]) == {"tokens": [1, 0xFFFFFFFF]}
    with pytest.raises(InvalidArgument, match="keys=prefix_hashes"):
        keys_or_tokens(None, np.array([1, 2**40 + 5], np.int64))


def test_keys_are_sent_as_they_are():
    hex_key = reference_get_hash_str([7])
    assert encode_key(hex_key) == hex_key.encode()
    assert encode_key(b"\x00\xff") == b"\x00\xff"
    with pytest.raises(ValueError):
        encode_key(b"x" * 65)
    with pytest.raises(ValueError):
        encode_key("")


def test_a_batch_of_keys_is_encoded_whatever_mix_of_str_and_bytes_it_holds():
    assert encode_keys(["a1", "é"]) == [b"a1", "é".encode()]
    assert encode_keys([b"a", "b", bytearray(b"c"), memoryview(b"d")]) == [b"a", b"b", b"c", b"d"]
    assert encode_keys(key for key in ["a", b"b", "c"]) == [b"a", b"b", b"c"]   # an iterator is read once
    for bad in (["a", 3], [b"a", ""], ["x" * 65]):
        with pytest.raises(ValueError):
            encode_keys(bad)


def test_namespace_id_is_stable_and_separates_layouts():
    a = Namespace(model="llama", page_bytes=4096, page_tokens=16)
    assert namespace_id(a) == namespace_id(Namespace(model="llama", page_bytes=4096, page_tokens=16))
    assert namespace_id(a) != namespace_id(Namespace(model="llama", page_bytes=8192, page_tokens=16))
    assert namespace_id(a) != namespace_id(Namespace(model="llama", page_bytes=4096, page_tokens=16, tenant="t"))
    assert Namespace.from_proto(a.to_proto()) == a


def test_salt_seeds_tell_salts_apart_and_leave_the_unsalted_seed_empty():
    assert salt_seed() == salt_seed("") == salt_seed("", "") == ""
    seeds = {salt_seed("a"), salt_seed("b"), salt_seed("ab", ""), salt_seed("a", "b"), salt_seed("", "ab")}
    assert len(seeds) == 5 and all(len(seed) == 64 and bytes.fromhex(seed) for seed in seeds)
    ns = Namespace(model="m", page_bytes=4096)
    assert namespace_id(ns) != namespace_id(Namespace(model="m", page_bytes=4096, hash_seed=salt_seed("a")))


def test_a_list_of_ids_is_read_as_the_array_of_it_would_be():
    """Lists take a faster path (array.array) than numpy's: the same ids, the same keys, the same refusals."""
    ids = list(range(0, 64_000, 7)) + [0xFFFFFFFF]
    assert token_array(ids).tolist() == ids and token_array(ids).dtype == np.uint32
    assert prefix_hashes(ids, 16) == prefix_hashes(np.array(ids, np.int64), 16)
    assert token_array(WIDE).tolist() == list(WIDE) and token_array(tuple(WIDE)).dtype == np.uint64
    for bad, match in (([1, -1], "0 to 9223372036854775807"), ([1, 2**63], "0 to 9223372036854775807"),
                       ([1, 2.0], "integers"), ([1, "2"], "integers|int")):
        with pytest.raises(InvalidArgument, match=match):
            token_array(bad)


def test_unpack_keys_gives_back_every_byte_of_each_key():
    from kvstore_client.keys import unpack_keys

    keys = [b"\x00" * 8, b"ab\x00\x00cd\x00\x00", bytes(range(248, 256)), b"\x00\x00\x00\x00\x00\x00\x00\x01"]
    assert unpack_keys(b"".join(keys), 8) == keys
    assert all(type(k) is bytes for k in unpack_keys(b"".join(keys), 8))
    assert unpack_keys(b"", 8) == []
