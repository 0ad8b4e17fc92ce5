"""kvstore_native agrees byte for byte with the pure-Python paths it replaces, on random inputs."""

import ctypes
import dataclasses
import errno
import hashlib
import re
import socket
import struct
import threading
import time

import numpy as np
import pytest
import xxhash

from kvstore_client import keys, native

pytestmark = pytest.mark.skipif(not native.available(), reason=f"kvstore_native not built: {native.missing_reason}")
kvstore_native = native.module


@pytest.mark.parametrize("dtype", ["<u4", "<i4", "<u8", "<i8"])
@pytest.mark.parametrize("page", [1, 3, 16, 64, 1500])
def test_prefix_hashes_equal_the_reference_chain(dtype, page):
    rng = np.random.default_rng(page)
    high = 2**31 - 1 if dtype == "<i4" else 2**32 - 1
    tokens = rng.integers(0, high, size=int(rng.integers(0, page * 20)), dtype=np.int64, endpoint=True)
    if dtype in ("<u8", "<i8") and len(tokens):   # some ids past uint32, so some pages hash wide, some not
        at = rng.integers(0, len(tokens), size=max(1, len(tokens) // (3 * page)))
        tokens[at] = rng.integers(2**32, 2**63 - 1, size=len(at), dtype=np.int64, endpoint=True)
    seed = hashlib.sha256(rng.bytes(8)).hexdigest() if page % 2 else ""
    expected = keys.prefix_hashes_python(tokens.tolist(), page, seed)
    assert keys.prefix_hashes(tokens.astype(dtype), page, seed) == expected
    assert keys.prefix_hashes(tokens.tolist(), page, seed) == expected


def test_prefix_hashes_take_torch_and_strided_input():
    torch = pytest.importorskip("torch")
    tokens = np.arange(0, 4096 * 3, 3, dtype=np.int64)
    expected = keys.prefix_hashes_python(tokens, 16)
    assert keys.prefix_hashes(torch.from_numpy(tokens), 16) == expected
    wide = np.repeat(tokens, 2)[::2]   # the same ids, not contiguous
    assert keys.prefix_hashes(wide, 16) == expected


@pytest.mark.parametrize("bad", [[-1], [2**63], np.array([0, 2**63], dtype=np.uint64), np.array([-5], dtype=np.int32)])
def test_token_ids_sglang_cannot_hash_are_refused_on_both_paths(bad):
    for chain in (keys.prefix_hashes, keys.prefix_hashes_python):
        with pytest.raises(ValueError, match="0 to 9223372036854775807"):
            chain(bad, 1)


@pytest.mark.parametrize("bad", [-1, 2**63])
def test_a_refused_token_in_the_last_page_refuses_the_call(bad):
    tokens = np.zeros(64, dtype=np.int64 if bad < 0 else np.uint64)
    tokens[-1] = bad
    with pytest.raises(ValueError, match="2\\*\\*63-1"):
        kvstore_native.prefix_hashes(tokens, 16, b"")


def test_float_token_ids_are_refused_not_truncated():
    for chain in (keys.prefix_hashes, keys.prefix_hashes_python):
        with pytest.raises(ValueError, match="integers"):
            chain([1.5, 2.0], 1)


def _kernels() -> list[str]:
    """xxh3's kernels this CPU runs: portable C, SSE2, and AVX2 and AVX-512F where the CPU has them."""
    kernels = ["scalar", "sse2"]
    for wide in ("avx2", "avx512"):
        try:
            kvstore_native.xxh3_64_kernel(b"", wide, None)
            kernels.append(wide)
        except RuntimeError:
            pass
    return kernels


@pytest.fixture(params=[k for k in ("sse2", "avx2", "avx512") if k in _kernels()] if kvstore_native else ["none"])
def copy_kernel(request):
    """The copies (copy_hash*, copy_out*, CopyHasher) kept to each kernel this CPU runs in turn, where otherwise
    they would run only the default choice (copy_kernel(None))."""
    assert kvstore_native.copy_kernel(request.param) == request.param
    yield request.param
    kvstore_native.copy_kernel(None)   # the default choice again


def _aligned(nbytes: int, misalign: int) -> tuple[np.ndarray, int]:
    storage = np.zeros(nbytes + 128, dtype=np.uint8)
    address = (storage.ctypes.data + 63) // 64 * 64 + misalign
    return storage, address


@pytest.mark.parametrize("misalign", [0, 1, 16, 17, 60])
def test_copy_hash_copies_and_equals_xxh3(misalign, copy_kernel):
    rng = np.random.default_rng(misalign)
    sizes = [0, 1, 15, 16, 17, 128, 129, 240, 241, 255, 1024, 4095, 4096, 4097, 65536 + 13, 1 << 20]
    for nbytes in sizes:
        source = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
        storage, dst = _aligned(nbytes, misalign)
        cuts = sorted(rng.integers(0, nbytes + 1, size=3).tolist()) if nbytes else []
        bounds = [0, *cuts, nbytes]
        segments = [(source.ctypes.data + a, b - a) for a, b in zip(bounds, bounds[1:])]
        got = kvstore_native.copy_hash(dst, segments)
        assert got == xxhash.xxh3_64_intdigest(source.tobytes()), nbytes
        assert ctypes.string_at(dst, nbytes) == source.tobytes(), nbytes
        assert kvstore_native.xxh3_64(source.tobytes()) == got


def test_copy_hash_pages_copies_each_page_to_its_offset():
    rng = np.random.default_rng(7)
    page = 4096 + 64
    source = rng.integers(0, 256, size=page * 5, dtype=np.uint8)
    storage, base = _aligned(page * 8, 0)
    offsets = [page * 7, 0, page * 3, page, page * 5]
    pages = [(offset, [(source.ctypes.data + i * page, page)]) for i, offset in enumerate(offsets)]
    sums = kvstore_native.copy_hash_pages(base, pages)
    for i, offset in enumerate(offsets):
        data = source[i * page:(i + 1) * page].tobytes()
        assert ctypes.string_at(base + offset, page) == data
        assert sums[i] == xxhash.xxh3_64_intdigest(data)


LENGTHS_EVERY = range(0, 2101)   # every length class (0, 1-3, 4-8, 9-16, 17-128, 129-240, long) and two blocks
SOURCE_BYTES = 6 << 20


@pytest.fixture(scope="module")
def source() -> np.ndarray:
    return np.random.default_rng(2100).integers(0, 256, size=SOURCE_BYTES, dtype=np.uint8)


def _random_cuts(rng: np.random.Generator, nbytes: int) -> list[int]:
    """Split points of a stream: a few anywhere (repeats make empty pieces), small steps, 4 KiB steps, or
    around the 64-byte stripes and the 1024-byte blocks."""
    kind = int(rng.integers(0, 5))
    if kind == 0 or nbytes == 0:
        return sorted(rng.integers(0, nbytes + 1, size=int(rng.integers(0, 8))).tolist())
    if kind == 1:
        return list(range(int(rng.integers(1, 200)), nbytes, int(rng.integers(1, 200))))[:4000]
    if kind == 2:
        return list(range(4096, nbytes, 4096))
    edges = range(64 if kind == 3 else 1024, nbytes, 64 if kind == 3 else 1024)[:500]   # and a byte either side
    return [edge + int(d) for edge, d in zip(edges, rng.integers(-1, 2, size=len(edges)))]


def _segments(rng: np.random.Generator, address: int, nbytes: int) -> list[tuple[int, int]]:
    bounds = [0, *sorted(rng.integers(0, nbytes + 1, size=int(rng.integers(0, 4))).tolist()), nbytes]
    return [(address + a, b - a) for a, b in zip(bounds, bounds[1:])]


def test_xxh3_64_equals_xxhash_for_every_length_and_kernel(source):
    data = source[:max(LENGTHS_EVERY)].tobytes()
    for nbytes in LENGTHS_EVERY:
        expected = xxhash.xxh3_64_intdigest(data[:nbytes])
        assert kvstore_native.xxh3_64(data[:nbytes]) == expected, nbytes
        for kernel in _kernels():
            assert kvstore_native.xxh3_64_kernel(data[:nbytes], kernel, None) == expected, (kernel, nbytes)


def test_xxh3_stream_equals_the_one_shot_for_any_split(source):
    """A digest is the one-shot hash whatever the pieces: every length to 2100, then random ones to 6 MiB."""
    rng = np.random.default_rng(3)
    lengths = [*LENGTHS_EVERY, *rng.integers(2101, SOURCE_BYTES, size=24).tolist(),
               SOURCE_BYTES, 1 << 20, (1 << 20) + 1]
    for nbytes in lengths:
        data = source[:nbytes]
        expected = xxhash.xxh3_64_intdigest(data)
        for kernel in _kernels():
            cuts = _random_cuts(rng, nbytes)
            assert kvstore_native.xxh3_64_kernel(data, kernel, cuts) == expected, (kernel, nbytes, cuts[:8])
        if nbytes > max(LENGTHS_EVERY):
            assert kvstore_native.xxh3_64(data) == expected, nbytes


def test_xxh3_kernel_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="kernel"):
        kvstore_native.xxh3_64_kernel(b"abc", "neon", None)
    with pytest.raises(ValueError, match="ascend"):
        kvstore_native.xxh3_64_kernel(b"abc", "scalar", [2, 1])
    with pytest.raises(ValueError, match="ascend"):
        kvstore_native.xxh3_64_kernel(b"abc", "scalar", [4])


def test_copy_hash_equals_xxh3_for_every_length(source, copy_kernel):
    rng = np.random.default_rng(4)
    storage, dst = _aligned(max(LENGTHS_EVERY), 3)
    for nbytes in LENGTHS_EVERY:
        start = int(rng.integers(0, SOURCE_BYTES - nbytes))
        data = source[start:start + nbytes]
        got = kvstore_native.copy_hash(dst, _segments(rng, data.ctypes.data, nbytes))
        assert got == xxhash.xxh3_64_intdigest(data), nbytes
        assert ctypes.string_at(dst, nbytes) == data.tobytes(), nbytes


def _pages_of(rng: np.random.Generator, source: np.ndarray, lengths: list[int]):
    """One page per length from random places in `source`, cut into random segments, and the
    offsets of back-to-back slots for them in shuffled order."""
    starts = [int(rng.integers(0, SOURCE_BYTES - n + 1)) for n in lengths]
    order = rng.permutation(len(lengths))
    offsets = [0] * len(lengths)
    at = 0
    for i in order:
        offsets[i] = at
        at += lengths[i]
    pages = [_segments(rng, source.ctypes.data + s, n) for s, n in zip(starts, lengths)]
    return starts, offsets, pages, at


@pytest.mark.parametrize("lengths", ["every", "mib"])
def test_copy_hash_pages_and_copy_out_hashed_equal_xxh3(source, lengths, copy_kernel):
    """Puts (copy_hash_pages) and gets (copy_out_hashed) of pages of every length to 2100, then of random
    lengths to 6 MiB, each page in random segments: the bytes land and the sums are xxhash's."""
    rng = np.random.default_rng(5 if lengths == "every" else 6)
    sizes = list(LENGTHS_EVERY) if lengths == "every" else rng.integers(0, SOURCE_BYTES, size=6).tolist()
    starts, offsets, pages, arena_bytes = _pages_of(rng, source, sizes)
    expected = [xxhash.xxh3_64_intdigest(source[s:s + n]) for s, n in zip(starts, sizes)]
    storage, base = _aligned(arena_bytes, 0)
    assert kvstore_native.copy_hash_pages(base, list(zip(offsets, pages))) == expected
    for s, n, offset in zip(starts, sizes, offsets):
        assert ctypes.string_at(base + offset, n) == source[s:s + n].tobytes()
    out = np.zeros(arena_bytes + 64, dtype=np.uint8)
    out_pages, at = [], out.ctypes.data + 1
    for n in sizes:
        out_pages.append(_segments(rng, at, n))
        at += n
    assert kvstore_native.copy_out_hashed(base, offsets, out_pages) == expected
    assert out[1:1 + arena_bytes].tobytes() == b"".join(source[s:s + n].tobytes() for s, n in zip(starts, sizes))


@pytest.mark.parametrize("seed", range(4))
def test_copies_into_aligned_pieces_hash_what_they_write(source, seed, copy_kernel):
    """Pages cut where every piece lands 32-byte aligned (those 64-byte aligned copied through the registers
    they are hashed from, where the CPU has AVX2), in segments of multiples of 32 bytes, short and long, so that a
    segment starts both at a stripe's end and in its middle: puts and gets land every byte and equal xxhash."""
    rng = np.random.default_rng(40 + seed)
    sizes = [int(n) * 32 for n in rng.integers(1, 40_000, size=6)] + [32, 384, 416, 4096, 4128, 1 << 20]
    starts = [int(rng.integers(0, SOURCE_BYTES - n + 1)) for n in sizes]
    expected = [xxhash.xxh3_64_intdigest(source[s:s + n]) for s, n in zip(starts, sizes)]
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    storage, base = _aligned(sum(sizes), 0)

    def cut(address: int, nbytes: int) -> list[tuple[int, int]]:
        bounds = sorted({0, nbytes, *(int(b) * 32 for b in rng.integers(0, nbytes // 32 + 1, size=3))})
        return [(address + a, b - a) for a, b in zip(bounds, bounds[1:])]

    pages = [cut(source.ctypes.data + s, n) for s, n in zip(starts, sizes)]
    assert kvstore_native.copy_hash_pages(base, list(zip(offsets, pages))) == expected
    assert ctypes.string_at(base, sum(sizes)) == b"".join(source[s:s + n].tobytes() for s, n in zip(starts, sizes))
    out_storage, out = _aligned(sum(sizes), 0)
    out_pages = [cut(out + offset, n) for offset, n in zip(offsets, sizes)]
    assert kvstore_native.copy_out_hashed(base, offsets, out_pages) == expected
    assert ctypes.string_at(out, sum(sizes)) == ctypes.string_at(base, sum(sizes))


@pytest.mark.parametrize("misalign", [4, 16, 48, 60, 2])
def test_gets_off_a_cache_line_land_every_byte_and_touch_nothing_around(source, misalign, copy_kernel):
    """numpy's own arrays start 16 bytes past a cache line. A get there (where the CPU has AVX-512F: whole lines
    streamed, each put together from two stripes, and masked stores at the two ends) lands every page, in segments
    cut at 4-byte steps, equals xxhash, and leaves the bytes before and after the buffer as they were."""
    rng = np.random.default_rng(misalign)
    sizes = [64, 100, 4096, 4096 + 48, 65536 + 4, 1 << 20, 3 * 4096 + 64 * 17, 257]
    starts = [int(rng.integers(0, SOURCE_BYTES - n + 1)) for n in sizes]
    expected = [xxhash.xxh3_64_intdigest(source[s:s + n]) for s, n in zip(starts, sizes)]
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    total = sum(sizes)
    storage, base = _aligned(total, 0)
    for s, n, offset in zip(starts, sizes, offsets):
        ctypes.memmove(base + offset, source.ctypes.data + s, n)
    guard = 256
    out_storage = np.full(total + 2 * guard, 0xA5, dtype=np.uint8)
    out = (out_storage.ctypes.data + guard // 2 + 63) // 64 * 64 + misalign
    out_pages = []
    for offset, n in zip(offsets, sizes):
        bounds = sorted({0, n, *(int(b) * 4 for b in rng.integers(0, n // 4 + 1, size=2))})
        out_pages.append([(out + offset + a, b - a) for a, b in zip(bounds, bounds[1:])])
    assert kvstore_native.copy_out_hashed(base, offsets, out_pages) == expected
    assert ctypes.string_at(out, total) == ctypes.string_at(base, total)
    before, after = out - out_storage.ctypes.data, out - out_storage.ctypes.data + total
    assert (out_storage[:before] == 0xA5).all() and (out_storage[after:] == 0xA5).all()


@pytest.mark.parametrize("seed", range(6))
def test_copy_hasher_streams_equal_xxh3_and_land_every_byte(source, seed, copy_kernel):
    """A stream copied in at random cuts (socket reads: anywhere, around stripes and blocks, 4 KiB steps), into a
    destination aligned or not, equals the one-shot xxh3 of the bytes, and those bytes are what landed."""
    rng = np.random.default_rng(60 + seed)
    for nbytes in (int(rng.integers(0, 2101)), int(rng.integers(2101, 300_000)), 3 << 20):
        start = int(rng.integers(0, SOURCE_BYTES - nbytes + 1))
        data = source[start:start + nbytes]
        storage, address = _aligned(nbytes, int(rng.choice([0, 32, 1, 17])))
        dst = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
        hasher = kvstore_native.CopyHasher()
        hasher.copy(dst, b"")   # an empty read feeds nothing
        bounds = [0, *(c for c in _random_cuts(rng, nbytes) if 0 <= c <= nbytes), nbytes]
        for a, b in zip(bounds, bounds[1:]):
            if b > a:
                hasher.copy(dst[a:], data[a:b])
        assert hasher.intdigest() == xxhash.xxh3_64_intdigest(data)
        assert ctypes.string_at(address, nbytes) == data.tobytes()
        hasher.reset()
        assert hasher.intdigest() == xxhash.xxh3_64_intdigest(b"")
        ctypes.memset(address, 0, nbytes)
        for a, b in zip(bounds, bounds[1:]):       # the same cuts unhashed: every byte lands, nothing is fed
            hasher.copy_unhashed(dst[a:], data[a:b])
        assert ctypes.string_at(address, nbytes) == data.tobytes()
        assert hasher.intdigest() == xxhash.xxh3_64_intdigest(b"")


def test_copy_kernel_keeps_the_copies_to_one_and_goes_back_to_the_default_choice():
    default = kvstore_native.copy_kernel(None)
    assert default in _kernels()   # the widest this CPU runs, or AVX2 where 512-bit work lowers its clock
    assert kvstore_native.copy_kernel("sse2") == "sse2"
    assert kvstore_native.copy_kernel(None) == default
    with pytest.raises(ValueError, match="'sse2', 'avx2' or 'avx512'"):
        kvstore_native.copy_kernel("avx1024")
    with pytest.raises(TypeError, match="kernel's name or None"):
        kvstore_native.copy_kernel(512)
    assert kvstore_native.copy_kernel(None) == default


def test_copy_hasher_refuses_what_it_cannot_copy():
    hasher = kvstore_native.CopyHasher()
    for copy in (hasher.copy, hasher.copy_unhashed):
        with pytest.raises(ValueError, match="into a buffer of 3"):
            copy(bytearray(3), b"four")
        with pytest.raises(TypeError):
            copy(b"read-only", b"x")
    with pytest.raises(TypeError):
        hasher.copy(b"read-only", b"x")            # the destination must be writable
    with pytest.raises(TypeError):
        hasher.copy(memoryview(bytearray(8))[::2], b"ab")   # nor a strided one
    with pytest.raises(TypeError):
        kvstore_native.CopyHasher(1)
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(b"")   # nothing was fed by the refused calls


def _send_in_pieces(sock: socket.socket, data: bytes, rng: np.random.Generator) -> threading.Thread:
    def send() -> None:
        at = 0
        while at < len(data):
            n = int(rng.integers(1, 200_000))
            sock.sendall(data[at:at + n])
            at += n
    sender = threading.Thread(target=send)
    sender.start()
    return sender


def test_copy_hasher_receives_a_page_from_a_socket_hashed_or_not(copy_kernel):
    """receive() fills the page from reads of any length, each through the buffer, and feeds the stream only
    when asked; a second page follows the first on the same stream of bytes."""
    rng = np.random.default_rng(70)
    hashed, unhashed = rng.bytes((3 << 20) + 5), rng.bytes(70_001)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        sender = _send_in_pieces(theirs, hashed + unhashed, rng)
        hasher, buffer = kvstore_native.CopyHasher(), memoryview(bytearray(256 << 10))
        first, second = bytearray(len(hashed)), bytearray(len(unhashed))
        hasher.receive(ours.fileno(), first, buffer, True, 0.0)
        assert bytes(first) == hashed and hasher.intdigest() == xxhash.xxh3_64_intdigest(hashed)
        hasher.reset()
        hasher.receive(ours.fileno(), second, buffer, False, time.monotonic() + 60)
        assert bytes(second) == unhashed and hasher.intdigest() == xxhash.xxh3_64_intdigest(b"")
        sender.join()


def test_copy_hasher_receive_stops_at_the_deadline_the_kernel_timeout_and_the_end_of_the_stream():
    buffer = memoryview(bytearray(4096))
    ours, theirs = socket.socketpair()
    with ours, theirs:
        hasher = kvstore_native.CopyHasher()
        with pytest.raises(TimeoutError) as late:                   # the call's deadline has passed
            hasher.receive(ours.fileno(), bytearray(10), buffer, True, time.monotonic() - 1)
        assert late.value.errno == errno.EAGAIN
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 50_000))
        theirs.sendall(b"abc")
        with pytest.raises(OSError) as stalled:                     # three bytes, then nothing for 50 ms
            hasher.receive(ours.fileno(), bytearray(10), buffer, True, 0.0)
        assert stalled.value.errno in (errno.EAGAIN, errno.EWOULDBLOCK)
        theirs.sendall(b"xy")
        theirs.close()
        with pytest.raises(ConnectionResetError):
            hasher.receive(ours.fileno(), bytearray(10), buffer, True, 0.0)
        with pytest.raises(ValueError, match="at least one byte"):
            hasher.receive(ours.fileno(), bytearray(10), memoryview(bytearray(0)), True, 0.0)
        with pytest.raises(TypeError):
            hasher.receive(ours.fileno(), b"read-only", buffer, True, 0.0)


def hashlib_chain(tokens: np.ndarray, page: int, prior: bytes) -> list[str]:
    """The prefix chain of every full page of uint32 `tokens`, hashlib page by page: the reference."""
    expected, digest = [], prior
    for p in range(len(tokens) // page):
        digest = hashlib.sha256(digest + tokens[p * page:(p + 1) * page].astype("<u4").tobytes()).digest()
        expected.append(digest.hex())
    return expected


def test_prefix_hashes_equal_hashlibs_sha256_chain():
    """The chain from libcrypto, against hashlib page by page: from uint32 tokens in place, and packed from int64."""
    rng = np.random.default_rng(12)
    for page, prior in ((64, b""), (1500, rng.bytes(32)), (1, rng.bytes(5))):
        tokens = rng.integers(0, 2**32 - 1, size=page * 7 + page // 2, dtype=np.uint32)   # and a partial page
        expected = hashlib_chain(tokens, page, prior)
        assert len(expected) == 7
        assert kvstore_native.prefix_hashes(tokens, page, prior) == expected
        assert kvstore_native.prefix_hashes(tokens.astype(np.int64), page, prior) == expected


SHA_KERNELS = [pytest.param(k, marks=pytest.mark.skipif(
    k == "sha_ni" and "sha_ni" not in open("/proc/cpuinfo").read(), reason="this CPU has no SHA extensions"))
    for k in ("libcrypto", "sha_ni")]


@pytest.mark.parametrize("kernel", SHA_KERNELS)
@pytest.mark.parametrize("page", [1, 7, 8, 9, 16, 17, 31, 32, 33, 64, 100, 1500])
def test_each_sha256_kernel_equals_hashlib_page_by_page(kernel, page):
    """Every page length (one, two or three padding cases a block), every prior length, uint32 in place and int64
    packed: the chain SHA-NI feeds from registers and the one through libcrypto both equal hashlib's."""
    rng = np.random.default_rng(page)
    for prior in (b"", rng.bytes(32), rng.bytes(5), rng.bytes(64), rng.bytes(70)):
        for pages in (0, 1, 2, 5):
            tokens = rng.integers(0, 2**32 - 1, size=page * pages + page // 2, dtype=np.uint32)
            expected = hashlib_chain(tokens, page, prior)
            assert len(expected) == pages
            assert kvstore_native.prefix_hashes(tokens, page, prior, kernel) == expected
            assert kvstore_native.prefix_hashes(tokens.astype(np.int64), page, prior, kernel) == expected
            assert kvstore_native.prefix_hashes_packed(tokens, page, prior, kernel) == "".join(expected).encode()


def test_an_unknown_sha256_kernel_is_refused():
    with pytest.raises(ValueError, match="kernel md5 is not one this CPU runs"):
        kvstore_native.prefix_hashes(np.zeros(16, dtype=np.uint32), 16, b"", "md5")


def test_bad_arguments_raise_not_crash():
    with pytest.raises(TypeError):
        kvstore_native.prefix_hashes(np.zeros(4, dtype=np.float32), 1, b"")
    with pytest.raises(ValueError):
        kvstore_native.prefix_hashes(np.zeros(4, dtype=np.uint32), 0, b"")
    with pytest.raises(TypeError):
        kvstore_native.copy_hash(0, [("x", 1)])


def _random_pages(rng: np.random.Generator, count: int, page: int) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
    """`count` pages of random bytes, each cut into 1 to 4 segments at random points, far apart in memory."""
    source = rng.integers(0, 256, size=count * page * 2, dtype=np.uint8)
    pages = []
    for i in range(count):
        start = source.ctypes.data + 2 * i * page
        bounds = [0, *sorted(rng.integers(0, page + 1, size=int(rng.integers(0, 4))).tolist()), page]
        pages.append([(start + a, b - a) for a, b in zip(bounds, bounds[1:])])
    return source, pages


@pytest.mark.parametrize("page", [1, 100, 4096, 65536 + 7])
def test_copy_hash_into_equals_the_python_path(page):
    """copy_hash_into writes what ArenaMapping.write (memmove) writes and returns xxh3 of each page."""
    rng = np.random.default_rng(page)
    count = int(rng.integers(1, 40))
    source, pages = _random_pages(rng, count, page)
    offsets = (rng.permutation(count) * page).tolist()
    native_arena, _ = _aligned(count * page, 0)
    python_arena = np.zeros(count * page, dtype=np.uint8)
    sums = kvstore_native.copy_hash_into(native_arena.ctypes.data + (-native_arena.ctypes.data % 64), offsets, pages)
    for offset, segments in zip(offsets, pages):
        dst = python_arena.ctypes.data + offset
        for src, nbytes in segments:
            ctypes.memmove(dst, src, nbytes)
            dst += nbytes
    start = -native_arena.ctypes.data % 64
    assert native_arena[start:start + count * page].tobytes() == python_arena.tobytes()
    assert sums == [xxhash.xxh3_64_intdigest(python_arena[o:o + page].tobytes()) for o in offsets]


@pytest.mark.parametrize("page", [1, 100, 4096, 65536 + 7])
def test_copying_rows_in_and_out_does_what_the_segment_lists_do(page, copy_kernel):
    """Pages back to back in one buffer, offsets as ints or as a buffer of uint64s: copy_hash_rows puts the same
    bytes in the same slots as copy_hash_into and copy_out_hashed_rows reads them back as copy_out_hashed does, with
    the same checksums, as uint64s."""
    rng = np.random.default_rng(page + 1)
    count = int(rng.integers(1, 40))
    rows = rng.integers(0, 256, size=count * page, dtype=np.uint8)
    offsets = (rng.permutation(count) * page).tolist()
    (by_rows, base_rows), (by_segments, base_segments) = _aligned(count * page, 0), _aligned(count * page, 0)
    written = lambda arena, base: arena[base - arena.ctypes.data:][:count * page].tobytes()
    expected = kvstore_native.copy_hash_into(base_segments, offsets,
                                             [[(rows.ctypes.data + i * page, page)] for i in range(count)])
    for given in (offsets, memoryview(np.asarray(offsets, dtype=np.uint64).tobytes()).cast("Q")):
        by_rows[:] = 0
        sums = kvstore_native.copy_hash_rows(base_rows, given, rows.ctypes.data, page, count)
        assert list(memoryview(sums).cast("Q")) == expected
        assert written(by_rows, base_rows) == written(by_segments, base_segments)
    out, expected_out = np.zeros_like(rows), np.zeros_like(rows)
    expected = kvstore_native.copy_out_hashed(base_segments, offsets,
                                              [[(expected_out.ctypes.data + i * page, page)] for i in range(count)])
    sums = kvstore_native.copy_out_hashed_rows(base_rows, offsets, out.ctypes.data, page, count)
    assert list(memoryview(sums).cast("Q")) == expected
    assert np.array_equal(out, rows) and np.array_equal(expected_out, rows)   # each page back from its slot
    with pytest.raises(ValueError, match="offsets for"):
        kvstore_native.copy_hash_rows(base_rows, offsets, rows.ctypes.data, page, count + 1)
    with pytest.raises(TypeError, match="uint64s"):
        kvstore_native.copy_hash_rows(base_rows, np.asarray(offsets, dtype=np.int32), rows.ctypes.data, page, count)


def _arena_and_two_outs(page: int, seed: int):
    """A random arena of pages in shuffled slots, and two zeroed outputs cut into the same random segments."""
    import os

    from kvstore_client.arena import ArenaMapping

    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 40))
    fd = os.memfd_create("arena")
    os.ftruncate(fd, count * page)
    arena = ArenaMapping(fd)
    arena.view[:] = rng.integers(0, 256, size=count * page, dtype=np.uint8).tobytes()
    offsets = (rng.permutation(count) * page).tolist()
    native_out, native_pages = _random_pages(rng, count, page)
    python_out = native_out.copy()
    shift = python_out.ctypes.data - native_out.ctypes.data
    python_pages = [[(address + shift, nbytes) for address, nbytes in segments] for segments in native_pages]
    return arena, offsets, (native_out, native_pages), (python_out, python_pages)


@pytest.mark.parametrize("page", [1, 100, 4096, 65536 + 7])
def test_read_pages_natively_equals_the_memmove_path(page, monkeypatch):
    """ArenaMapping.read_pages fills each page's segments from its slot, the same with kvstore_native
    (copy_out) as without (memmove per segment)."""
    arena, offsets, (native_out, native_pages), (python_out, python_pages) = _arena_and_two_outs(page, seed=page + 1)
    arena.read_pages(offsets, native_pages)
    monkeypatch.setattr(native, "module", None)
    arena.read_pages(offsets, python_pages)
    assert native_out.tobytes() == python_out.tobytes()
    for offset, segments in zip(offsets, native_pages):
        assert b"".join(ctypes.string_at(a, n) for a, n in segments) == arena.view[offset:offset + page].tobytes()
    arena.close()


@pytest.mark.parametrize("page", [1, 100, 4096, 65536 + 7])
def test_read_pages_hashed_natively_equals_the_python_path(page, monkeypatch):
    """ArenaMapping.read_pages_hashed fills each page's segments and returns the xxh3 of what landed, the
    same with kvstore_native (copy_out_hashed) as without (memmove and xxhash)."""
    arena, offsets, (native_out, native_pages), (python_out, python_pages) = _arena_and_two_outs(page, seed=page + 2)
    native_sums = arena.read_pages_hashed(offsets, native_pages)
    monkeypatch.setattr(native, "module", None)
    python_sums = arena.read_pages_hashed(offsets, python_pages)
    assert native_out.tobytes() == python_out.tobytes()
    assert native_sums == python_sums == [xxhash.xxh3_64_intdigest(arena.view[o:o + page]) for o in offsets]
    arena.close()


def test_batch_copies_refuse_bad_batches():
    page = np.zeros(64, dtype=np.uint8)
    for copy in (kvstore_native.copy_hash_into, kvstore_native.copy_out, kvstore_native.copy_out_hashed):
        with pytest.raises(ValueError, match="2 offsets for 1 pages"):
            copy(page.ctypes.data, [0, 0], [[(page.ctypes.data, 8)]])
        with pytest.raises(TypeError):
            copy(page.ctypes.data, [0], [[(page.ctypes.data, "8")]])
        with pytest.raises(TypeError):
            copy(page.ctypes.data, [0], [(page.ctypes.data, 8)])
        with pytest.raises(ValueError, match="negative"):
            copy(page.ctypes.data, [0], [[(page.ctypes.data, -1)]])
        assert copy(page.ctypes.data, [], []) in ([], None)


def test_packed_prefix_hashes_are_the_chain_back_to_back():
    rng = np.random.default_rng(7)
    for page in (1, 16, 100):
        tokens = rng.integers(0, 2**32 - 1, size=int(rng.integers(0, page * 30)), dtype=np.uint32)
        seed = hashlib.sha256(rng.bytes(8)).hexdigest() if page != 16 else ""
        chain = keys.prefix_hashes_python(tokens, page, seed)
        assert keys.prefix_hashes_packed(tokens, page, seed) == "".join(chain).encode("ascii")
        assert kvstore_native.prefix_hashes_packed(tokens, page, bytes.fromhex(seed)) == "".join(chain).encode()


def _random_key_lists(rng):
    """Lists of keys as callers pass them: hex str, binary bytes, mixed lengths and kinds, odd types."""
    for _ in range(300):
        n = int(rng.integers(0, 40))
        width = int(rng.integers(1, 70))
        kind = rng.integers(0, 6)
        if kind == 0:
            yield [rng.bytes(width).hex()[:width] for _ in range(n)]
        elif kind == 1:
            yield [rng.bytes(width) for _ in range(n)]
        elif kind == 2:   # one key a different length
            batch = [rng.bytes(width) for _ in range(n)]
            if batch:
                batch[int(rng.integers(0, n))] = rng.bytes(width + 1)
            yield batch
        elif kind == 3:   # str and bytes mixed, or a bytearray among bytes
            batch = [rng.bytes(width) for _ in range(n)]
            if batch:
                i = int(rng.integers(0, n))
                batch[i] = batch[i].hex()[:width] if rng.integers(0, 2) else bytearray(batch[i])
            yield batch
        elif kind == 4:   # non-ASCII text
            yield ["é" * width for _ in range(n)]
        else:
            yield tuple(rng.bytes(width).hex()[:width] for _ in range(n))


def test_pack_keys_native_equals_python_on_random_lists():
    rng = np.random.default_rng(11)
    packed_some = 0
    for batch in _random_key_lists(rng):
        expected = keys.pack_keys_python(batch)
        assert keys.pack_keys(batch) == expected
        native_answer = kvstore_native.pack_keys(batch, keys.KEY_BYTES_MAX)
        assert native_answer is None or native_answer == expected   # it declines only what Python decides
        packed_some += expected is not None
    assert packed_some > 50


def test_encode_keys_native_equals_python_on_random_lists(monkeypatch):
    """The same bytes for every list native encode_keys takes; what it declines, the Python path encodes or refuses."""
    rng = np.random.default_rng(13)
    odd = [["a", ""], [b"k", b"x" * (keys.KEY_BYTES_MAX + 1)], ["k" * keys.KEY_BYTES_MAX], ["ok", 3],
           [memoryview(b"m")]]
    encoded_natively = 0
    for batch in [*_random_key_lists(rng), *odd]:
        native_answer = kvstore_native.encode_keys(batch, keys.KEY_BYTES_MAX)
        with monkeypatch.context() as python_only:
            python_only.setattr(native, "encode_keys", None)
            try:
                expected = keys.encode_keys(batch)
            except ValueError as refused:
                expected = refused
        if isinstance(expected, ValueError):
            assert native_answer is None
            with pytest.raises(ValueError, match=re.escape(str(expected))):
                keys.encode_keys(batch)
            continue
        assert native_answer is None or native_answer == expected
        assert keys.encode_keys(batch) == expected and all(type(k) is bytes for k in expected)
        encoded_natively += native_answer is not None
    assert encoded_natively > 150


def test_a_reserves_keys_are_checked_natively_as_the_python_path_checks_them(monkeypatch):
    """checks.keys takes distinct_keys' list where every key is fine, and where one is not (empty, too long, not
    bytes, a repeat, however far apart) distinct_keys declines and the Python path refuses naming it."""
    from kvstore import config
    from kvstore.control import checks
    from kvstore.limits import Limits
    from kvstore_client import errors
    from kvstore_client.proto import pb

    limits = dataclasses.replace(Limits.from_config(config.load(environ={}, overrides=[])), key_bytes_max=32)
    rng = np.random.default_rng(17)
    for _ in range(200):
        batch = [bytes(rng.integers(97, 100, size=int(rng.integers(1, 4)), dtype=np.uint8))
                 for _ in range(int(rng.integers(1, 40)))]
        batch = list(dict.fromkeys(batch))   # distinct, so far
        if rng.random() < 0.5:   # a repeat somewhere
            batch.insert(int(rng.integers(0, len(batch) + 1)), batch[int(rng.integers(0, len(batch)))])
        repeated = len(set(batch)) != len(batch)
        given = pb.ReserveRequest(keys=batch).keys
        assert (kvstore_native.distinct_keys(given, limits.key_bytes_max) is None) == repeated
        with monkeypatch.context() as python_only:
            python_only.setattr(native, "distinct_keys", None)
            if repeated:
                with pytest.raises(errors.DuplicateKey):
                    checks.keys(given, limits)
            else:
                assert checks.keys(given, limits) == batch
        if not repeated:
            answer = checks.keys(given, limits)
            assert answer == batch and all(type(k) is bytes for k in answer)
    for bad in ([b"ok", b""], [b"x" * 33], ["str"], [b"a", bytearray(b"b")]):
        assert kvstore_native.distinct_keys(bad, 32) is None
    assert kvstore_native.distinct_keys([b"x" * 32], 32) == [b"x" * 32]
    with pytest.raises(errors.InvalidArgument, match=r"keys\[1\] has 0 bytes"):
        checks.keys([b"ok", b""], limits)


def test_claiming_keys_takes_all_of_them_or_none_and_unclaiming_takes_each_out():
    claimed = {b"held": 1}
    assert kvstore_native.claim_keys(claimed, [b"a", b"b"], 7) is True
    assert claimed == {b"held": 1, b"a": 7, b"b": 7}
    assert kvstore_native.claim_keys(claimed, [b"c", b"d", b"held", b"e"], 8) is False   # one is held: none taken
    assert claimed == {b"held": 1, b"a": 7, b"b": 7}
    assert kvstore_native.claim_keys(claimed, [b"c", b"a"], 8) is False
    assert claimed == {b"held": 1, b"a": 7, b"b": 7}
    with pytest.raises(TypeError):
        kvstore_native.claim_keys(claimed, [b"f", "str"], 9)
    assert claimed == {b"held": 1, b"a": 7, b"b": 7}
    kvstore_native.unclaim_keys(claimed, [b"a", b"b"])
    assert claimed == {b"held": 1}
    with pytest.raises(KeyError):
        kvstore_native.unclaim_keys(claimed, [b"held", b"gone"])
    assert claimed == {}


def test_spinning_for_a_frame_returns_once_one_waits_or_the_peer_is_gone_and_not_before():
    ours, theirs = socket.socketpair()
    try:
        assert kvstore_native.spin_until_readable(ours.fileno(), 0.0) is False
        assert kvstore_native.spin_until_readable(ours.fileno(), 0.002) is False
        theirs.sendall(b"frame")
        assert kvstore_native.spin_until_readable(ours.fileno(), 60.0) is True   # at once: the bytes are there
        assert ours.recv(16) == b"frame"
        theirs.close()
        assert kvstore_native.spin_until_readable(ours.fileno(), 60.0) is True   # the read that follows sees EOF
        assert ours.recv(16) == b""
    finally:
        ours.close()


def test_key_set_agrees_with_a_python_set_through_adds_and_discards():
    """KeySet (open addressing, backward-shift deletion) against a set: membership of every key ever seen,
    length, its keys, and leading runs by list and packed, after every burst of random adds and discards
    (a pool small enough that keys come and go many times, so runs of probes are shifted often)."""
    import random

    rng = random.Random(5)
    pool = [rng.randbytes(rng.choice([0, 1, 8, 32, 64])) for _ in range(3000)]
    fixed = sorted({key for key in pool if len(key) == 64})
    native_set, reference = kvstore_native.KeySet(), set()
    for _ in range(60):
        for _ in range(rng.randint(1, 400)):
            key = rng.choice(pool)
            if rng.random() < 0.55:
                native_set.add(key)
                reference.add(key)
            else:
                native_set.discard(key)
                reference.discard(key)
        assert len(native_set) == len(reference) and set(native_set) == reference
        assert [key in native_set for key in pool] == [key in reference for key in pool]
        chain = rng.sample(fixed, 40)
        chain.sort(key=lambda key: key not in reference)   # a run of held keys, then the rest
        start = rng.randrange(len(chain))
        expected = next((i for i, key in enumerate(chain[start:]) if key not in reference), len(chain) - start)
        assert native_set.leading(chain, start=start) == expected
        assert native_set.leading(b"".join(chain), 64, start) == expected


def test_key_set_refuses_what_is_not_bytes_keys():
    key_set = kvstore_native.KeySet([b"a"])
    with pytest.raises(TypeError):
        key_set.add("a")
    with pytest.raises(ValueError):
        key_set.leading(b"abc", 2)
    with pytest.raises(ValueError):
        key_set.leading(b"ab", -1)
    assert "a" not in key_set and key_set.leading([b"a", "a", b"a"]) == 1 and key_set.leading(b"aab", 1, 5) == 0


def test_token_ids_u32_equals_array_packing_and_declines_what_does_not_fit():
    import array

    rng = np.random.default_rng(9)
    for size in (0, 1, 17, 4096):
        for high in (2**32, 2**30):   # ids past an int's one internal digit, and only ids within it (read directly)
            ids = rng.integers(0, high, size=size, dtype=np.uint64).tolist()
            ids[:4] = [0, high - 1, 2**30 - 1, 2**30 if high > 2**30 else 1][:size]
            assert kvstore_native.token_ids_u32(ids) == array.array("I", ids).tobytes()
            assert kvstore_native.token_ids_u32(tuple(ids)) == array.array("I", ids).tobytes()
    for odd in ([1, -1], [-(2**30)], [-(2**30) - 1], [2**32], [2**64 + 1], [1, True], [1.0], ["1"], [1, None]):
        assert kvstore_native.token_ids_u32(odd) is None, odd   # token_array's general path decides
    with pytest.raises(TypeError):
        kvstore_native.token_ids_u32(np.arange(3))
