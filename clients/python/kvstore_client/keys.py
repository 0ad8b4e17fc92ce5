"""Namespaces and prefix hashes.

A page's key names its whole prefix: key_i = SHA-256(key_{i-1} || tokens_i as uint32 LE),
byte-identical to SGLang's `get_hash_str`, so an engine and this SDK agree on the key of
the same prefix. A page holding an id past uint32 (a multimodal pad value) is hashed as SGLang
hashes it: SHA-256(key_{i-1} || 0xff || tokens_i as uint64 LE), the odd byte count keeping it
apart from every uint32 page; ids up to 2**63 - 1, as SGLang takes. Engines that bring their own keys pass them as they are: `str` keys
travel as their UTF-8 bytes (SGLang's 64-character hex digests fit exactly), `bytes`
keys travel unchanged; either way at most KEY_BYTES_MAX bytes.
"""

from __future__ import annotations

import binascii
import dataclasses
import hashlib
import json
from typing import Iterable, Sequence, Union

import numpy as np

from kvstore_client import native
from kvstore_client.errors import InvalidArgument
from kvstore_client.proto import pb
from kvstore_client.tokens import NARROW_TOKEN_ID_MAX, token_array

KEY_BYTES_MAX = 64
WIDE_PAGE_TAG = b"\xff"   # leads the tokens of a page with an id past uint32 (SGLang's hash_binding.cpp)

Key = Union[str, bytes]


@dataclasses.dataclass(frozen=True)
class Namespace:
    """What makes pages comparable; fixes page_bytes. Pages of different namespaces never mix."""

    model: str
    page_bytes: int
    page_tokens: int = 0
    tenant: str = ""
    kv_dtype: str = ""
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    layout: str = ""
    hash_seed: str = ""

    def to_proto(self) -> pb.NamespaceSpec:
        return pb.NamespaceSpec(**dataclasses.asdict(self))

    @classmethod
    def from_proto(cls, spec: pb.NamespaceSpec) -> "Namespace":
        return cls(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(cls)})


def namespace_id(namespace: Namespace) -> int:
    """A stable 64-bit id: the same spec gets the same id on every server and restart."""
    canonical = json.dumps(dataclasses.asdict(namespace), sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(canonical.encode()).digest()[:8], "little")


def salt_seed(*salts: str) -> str:
    """A namespace's hash_seed for engine salts ("" for none): salted pages share no namespace, and
    so no page, with unsalted ones or with another salt's. Each part is length-prefixed, so
    ("ab", "") and ("a", "b") differ."""
    if not any(salts):
        return ""
    digest = hashlib.sha256(b"kvstore-salt-v1")
    for salt in salts:
        encoded = salt.encode()
        digest.update(len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def page_hash(page_tokens: Sequence[int] | np.ndarray, prior_hash: str | None = None) -> str:
    """SGLang's get_hash_str: SHA-256 over the prior digest, then each token as uint32 LE, or where one
    is past uint32, 0xff and each as uint64 LE. Ids outside 0..2**63-1 are refused (InvalidArgument),
    as SGLang refuses them; none is ever cut short."""
    array = token_array(page_tokens)
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    if array.size and array.max() > NARROW_TOKEN_ID_MAX:
        hasher.update(WIDE_PAGE_TAG + array.astype("<u8").tobytes())
    else:
        hasher.update(array.astype("<u4").tobytes())
    return hasher.hexdigest()


def prefix_hashes(tokens: Sequence[int] | np.ndarray, page_tokens: int, seed: str = "") -> list[str]:
    """Keys of every full page of `tokens`; a trailing partial page gets no key.

    One native call for the whole prompt where kvstore_native is installed (numpy arrays and CPU
    tensors of 32- or 64-bit integers are hashed in place), else prefix_hashes_python.
    """
    if native.module is None:
        return prefix_hashes_python(tokens, page_tokens, seed)
    _check_page_tokens(page_tokens)
    array = token_array(tokens)
    return native.module.prefix_hashes(array, page_tokens, bytes.fromhex(seed))


def prefix_hashes_packed(tokens: Sequence[int] | np.ndarray, page_tokens: int, seed: str = "") -> bytes:
    """The keys of prefix_hashes as ASCII, 64 bytes each, back to back (a Lookup's keys_packed):
    one buffer, without a str per page, where kvstore_native has it."""
    if native.prefix_hashes_packed is None:
        return "".join(prefix_hashes(tokens, page_tokens, seed)).encode("ascii")
    _check_page_tokens(page_tokens)
    return native.prefix_hashes_packed(token_array(tokens), page_tokens, bytes.fromhex(seed))


def prefix_hashes_python(tokens: Sequence[int] | np.ndarray, page_tokens: int, seed: str = "") -> list[str]:
    """The reference chain, page by page with hashlib: what the native path must equal byte for byte."""
    _check_page_tokens(page_tokens)
    array = token_array(tokens)
    keys: list[str] = []
    prior = seed or None
    for start in range(0, len(array) - page_tokens + 1, page_tokens):
        prior = page_hash(array[start:start + page_tokens], prior)
        keys.append(prior)
    return keys


def _check_page_tokens(page_tokens: int) -> None:
    if not isinstance(page_tokens, (int, np.integer)) or page_tokens <= 0:
        raise InvalidArgument(f"page_tokens must be a positive int, got {page_tokens!r}")


_BYTES = (bytes, bytearray, memoryview)


def encode_key(key: Key) -> bytes:
    if isinstance(key, str):
        raw = key.encode()
    elif isinstance(key, _BYTES):
        raw = bytes(key)
    else:   # bytes(3) would be three zero bytes: an int is a token id passed where a key belongs
        raise InvalidArgument(f"a key is a str or bytes prefix hash, got {type(key).__name__} {key!r}; for token "
                              "ids use prefix_hashes(tokens, page_tokens) or the call's tokens= argument")
    if not 0 < len(raw) <= KEY_BYTES_MAX:
        raise InvalidArgument(f"a key must be 1 to {KEY_BYTES_MAX} bytes, got {len(raw)}")
    return raw


def encode_keys(keys: Iterable[Key]) -> list[bytes]:
    if isinstance(keys, (str, bytes)) or not hasattr(keys, "__iter__"):
        raise InvalidArgument(f"keys must be a sequence of keys, got {type(keys).__name__}")
    if not isinstance(keys, (list, tuple)):
        keys = list(keys)   # walked twice below when not all str
    if native.encode_keys is not None:   # ASCII str and bytes keys, checked and encoded in one native pass
        raw = native.encode_keys(keys, KEY_BYTES_MAX)
        if raw is not None:
            return raw
    try:   # str keys, encoded in one pass in C
        raw = list(map(str.encode, keys))
    except (TypeError, AttributeError):
        raw = [k.encode() if isinstance(k, str) else bytes(k) if isinstance(k, _BYTES) else encode_key(k) for k in keys]
    sizes = set(map(len, raw))   # checked once over the batch: a long prompt is thousands of keys
    if sizes and (min(sizes) == 0 or max(sizes) > KEY_BYTES_MAX):
        bad = next(len(k) for k in raw if not 0 < len(k) <= KEY_BYTES_MAX)
        raise InvalidArgument(f"a key must be 1 to {KEY_BYTES_MAX} bytes, got {bad}")
    return raw


def pack_keys(keys: Sequence[Key]) -> tuple[bytes, int] | None:
    """Keys of one length back to back, and that length: a long chain as one buffer (a Lookup's
    keys_packed). None when they are not all str or all bytes-like, or lengths differ or are out of
    range; encode_keys then takes them one by one (and says which key is wrong). One native pass
    where kvstore_native has it; it packs only what pack_keys_python packs, and leaves the rest to it."""
    packed = native.pack_keys(keys, KEY_BYTES_MAX) if native.pack_keys is not None else None
    return packed if packed is not None else pack_keys_python(keys)


HEX_DIGITS = b"0123456789abcdef"
HEX_KEY_BYTES = 64      # a token chain's key: a SHA-256 digest in hex
HEX_DIGEST_BYTES = 32   # the bytes a hex key's digits spell


def hex_digests(packed: bytes) -> bytes | None:
    """Packed keys of 64 lowercase hex digits each (a token chain's) as the 32 bytes each spells, back to back:
    a Lookup's keys in half the bytes (LookupRequest.hex_digests). None unless every key is such digits
    (an uppercase digit makes another key). One native pass where kvstore_native has it."""
    if native.hex_digests is not None:
        return native.hex_digests(packed)
    return hex_digests_python(packed)


def hex_digests_python(packed: bytes) -> bytes | None:
    """hex_digests without kvstore_native: what the native pass must equal."""
    if len(packed) % HEX_KEY_BYTES or bytes(packed).translate(None, HEX_DIGITS):
        return None
    return binascii.unhexlify(packed)


def unpack_keys(packed: bytes, key_bytes: int, digests: bool = False) -> list[bytes]:
    """Keys of `key_bytes` each, back to back, as a list of bytes: one numpy pass (a void dtype keeps every
    byte, NULs too), five times faster than slicing key by key. With digests, hex keys' 32 bytes each
    (hex_digests), listed as their 64 digits."""
    if digests:
        packed, key_bytes = binascii.hexlify(packed), HEX_KEY_BYTES
    return np.frombuffer(packed, dtype=f"V{key_bytes}").tolist() if packed else []


def pack_keys_python(keys: Sequence[Key]) -> tuple[bytes, int] | None:
    """pack_keys without kvstore_native: what the native pass must equal."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence) or not keys:
        return None
    try:   # one join in C checks every element's type: str for all, or bytes-like for all
        packed = "".join(keys) if isinstance(keys[0], str) else b"".join(keys)
    except TypeError:
        return None
    if isinstance(packed, str):
        if not packed.isascii():   # a non-ASCII key's UTF-8 is longer than its characters
            return None
        packed = packed.encode("ascii")
    key_bytes = len(packed) // len(keys)
    if not 0 < key_bytes <= KEY_BYTES_MAX or len(packed) != key_bytes * len(keys):
        return None
    if set(map(len, keys)) != {key_bytes}:   # the right total from keys of different lengths
        return None
    return packed, key_bytes
