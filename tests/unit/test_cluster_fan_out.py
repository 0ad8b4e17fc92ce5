"""A cluster call's pieces run at once, and the call returns, with its answers or its error, only once
every piece has ended: a piece still running may be copying into the caller's buffer."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstore_client import errors
from kvstore_client.cluster import fan_out


@pytest.fixture
def pool():
    with ThreadPoolExecutor(max_workers=4) as executor:
        yield executor


def test_an_error_is_raised_only_after_every_other_piece_has_ended(pool):
    landed = threading.Event()

    def refused():
        raise errors.ChecksumMismatch("a page changed")

    def slow_copy():
        time.sleep(0.3)
        landed.set()   # the bytes a failed call would otherwise leave landing in `out`
        return 1

    with pytest.raises(errors.ChecksumMismatch):
        fan_out(pool, [refused, slow_copy, slow_copy], miss=0)
    assert landed.is_set(), "the call returned while a piece was still running"


def test_a_lost_node_answers_the_miss_and_the_others_their_results(pool):
    def lost():
        raise errors.Unavailable("node gone")

    assert fan_out(pool, [lambda: 3, lost, lambda: 5], miss=0) == [3, 0, 5]
