"""Landings (kvstore_client/landing.py): bytes read a piece at a time land in place, and their hash is xxh3's."""

import numpy as np
import pytest
import xxhash

from kvstore_client import landing, native


def _landings() -> list:
    made = [landing.DirectLanding()]
    if native.CopyHasher is not None:
        made.append(landing.CopiedLanding(landing.landing_buffer()))
    return made


def _receive(where, dst: memoryview, data: bytes, rng: np.random.Generator) -> None:
    """What a socket reader does: ask where the next bytes go, write at most that many there (a short read as often
    as not), say how many landed."""
    got = 0
    while got < len(data):
        rest = dst[got:]
        place = where.place(rest)
        assert 0 < len(place) <= len(rest)
        n = min(len(place), int(rng.integers(1, 3 * landing.LANDING_BYTES)))
        place[:n] = data[got:got + n]
        where.landed(rest, n)
        got += n


@pytest.mark.parametrize("nbytes", [1, 240, 4097, 1 << 20, (3 << 20) + 13])
def test_every_landing_puts_the_bytes_in_place_and_hashes_them(nbytes):
    rng = np.random.default_rng(nbytes)
    data = rng.bytes(nbytes)
    for where in _landings():
        for _ in range(2):   # a second page after reset() starts a new hash
            dst = bytearray(nbytes)
            where.reset()
            _receive(where, memoryview(dst), data, rng)
            assert bytes(dst) == data, type(where).__name__
            assert where.intdigest() == xxhash.xxh3_64_intdigest(data), type(where).__name__


def test_a_page_landed_unhashed_is_in_place_and_the_next_one_is_hashed_again():
    rng = np.random.default_rng(7)
    vouched, hashed = rng.bytes((1 << 20) + 5), rng.bytes(70_000)
    for where in _landings():
        dst = bytearray(len(vouched))
        where.reset(hashed=False)
        _receive(where, memoryview(dst), vouched, rng)
        assert bytes(dst) == vouched and where.intdigest() == xxhash.xxh3_64_intdigest(b""), type(where).__name__
        dst = bytearray(len(hashed))
        where.reset()
        _receive(where, memoryview(dst), hashed, rng)
        assert bytes(dst) == hashed and where.intdigest() == xxhash.xxh3_64_intdigest(hashed), type(where).__name__


def test_reads_are_bounded_by_the_landing_not_the_page():
    direct = landing.DirectLanding()
    assert len(direct.place(memoryview(bytearray(landing.DIRECT_PIECE_BYTES + 1)))) == landing.DIRECT_PIECE_BYTES
    assert len(direct.place(memoryview(bytearray(5)))) == 5
    if native.CopyHasher is None:
        assert isinstance(landing.new_landing(), landing.DirectLanding)
        return
    shared = landing.landing_buffer()
    copied = landing.new_landing(shared)
    assert isinstance(copied, landing.CopiedLanding)
    place = copied.place(memoryview(bytearray(4 << 20)))
    assert len(place) == landing.LANDING_BYTES
    place[:3] = b"abc"
    assert bytes(shared[:3]) == b"abc"   # it reads into the buffer it was given, not the page


@pytest.mark.skipif(native.CopyHasher is None, reason="CopiedLanding needs kvstore_native's CopyHasher")
def test_a_hashed_page_cut_part_way_through_a_line_is_read_to_the_line_end_next():
    """CopyHasher copies and hashes in one pass only from a 64-byte line on: after a read that stops part-way
    through one, the next read goes only to its end, and the one after is whole again. Unhashed pages read whole."""
    copied = landing.CopiedLanding(landing.landing_buffer())
    page = memoryview(bytearray(1 << 20))
    copied.reset()
    first = copied.place(page)
    first[:2520] = bytes(2520)
    copied.landed(page, 2520)                       # 39 lines and 24 bytes
    assert len(copied.place(page[2520:])) == 64 - 24
    copied.landed(page[2520:], 40)
    assert len(copied.place(page[2560:])) == landing.LANDING_BYTES
    copied.reset(hashed=False)
    copied.landed(page, 100)
    assert len(copied.place(page[100:])) == landing.LANDING_BYTES
