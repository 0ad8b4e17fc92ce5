"""Local-channel frames round-trip, refuse oversized lengths, and number methods from the proto."""

import pytest

from kvstore_client import framing
from kvstore_client.proto import pb


def test_method_ids_follow_the_proto():
    names = [m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods]
    assert [framing.METHODS[i][0] for i in sorted(framing.METHODS)] == names
    assert framing.MAP_ARENA not in framing.METHODS


def test_round_trip_and_limits():
    frame = framing.encode(3, b"abc")
    assert framing.decode_header(frame[:framing.HEADER.size]) == (3, 3)
    with pytest.raises(framing.FrameError):
        framing.decode_header(framing.HEADER.pack(framing.FRAME_BYTES_MAX + 1, 1))
    with pytest.raises(framing.FrameError):
        framing.encode(1, b"x" * (framing.FRAME_BYTES_MAX + 1))
