"""Prefix hashes are byte-identical to SGLang's get_hash_str chain, and namespaces are stable ids."""

import hashlib

import numpy as np
import pytest

from kvstore_client.keys import Namespace, encode_key, encode_keys, namespace_id, page_hash, prefix_hashes, salt_seed


def reference_get_hash_str(token_ids, prior_hash=None):
    """The published algorithm (sglang/srt/mem_cache/hicache_storage.py), written out."""
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    for t in token_ids:
        hasher.update(t.to_bytes(4, byteorder="little", signed=False))
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


@pytest.mark.parametrize("ids", [[2**32], np.array([2**40 + 5], np.int64), np.array([-1], np.int64)])
def test_token_ids_outside_uint32_are_refused(ids):
    """Never cut to 32 bits: 2**40 + 5 would hash as 5, another prompt's page."""
    with pytest.raises(ValueError, match="uint32"):
        prefix_hashes(ids, 1)
    with pytest.raises(ValueError, match="uint32"):
        page_hash(ids)
    assert page_hash(np.array([5], np.int64)) == reference_get_hash_str([5])


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
