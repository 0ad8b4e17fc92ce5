"""The TCP data plane's frames and the server's request reader: where each byte goes, and what is refused."""

import tracemalloc

import pytest

from kvstore_client import tcp_framing as tf
from kvstore_client.tcp_framing import Event, FrameError, Op, Request, RequestReader

TOKEN = bytes(range(16))


def feed(reader: RequestReader, data: bytes, step: int, targets: list, moved: list | None = None):
    """Receive `data` as the I/O layer would, at most `step` bytes per recv, taking what each read brought
    ahead (frames, and body bytes moved as if read: their sizes go in `moved`); returns the events.

    Each PUT or CALL body goes into the next of `targets` (None: refused, skipped)."""
    events, position = [], 0

    def take(event):
        while True:
            if event is not None:
                events.append(event)
                if isinstance(event, Request) and event.op in (Op.PUT, Op.CALL) and event.length:
                    target = targets.pop(0)
                    if target is None:
                        reader.skip_body()
                    else:
                        reader.accept_body(target)
            if reader.read_ahead():
                n = reader.move_read_ahead(reader.buffer())
                if moved is not None:
                    moved.append(n)
                event = reader.received(n)
            else:
                event = reader.next_frame()
                if event is None and not reader.read_ahead():
                    return

    while position < len(data):
        target = reader.buffer()
        n = min(step, len(target), len(data) - position)
        target[:n] = data[position:position + n]
        position += n
        take(reader.received(n))
    return events


@pytest.mark.parametrize("step", [1, 7, 40, 1 << 20])
def test_put_body_lands_in_the_accepted_view_and_gets_follow(step):
    slot = memoryview(bytearray(1000))
    body = bytes(i % 251 for i in range(1000))
    stream = (tf.encode_request(Op.PUT, 5, TOKEN, 3, 1000) + body
              + tf.encode_request(Op.GET, 6, TOKEN, 0, 1000))
    reader = RequestReader(4096, memoryview(bytearray(64)))
    events = feed(reader, stream, step, [slot])
    assert events == [Request(Op.PUT, 1000, 5, TOKEN, 3), Event.BODY_DONE, Request(Op.GET, 1000, 6, TOKEN, 0)]
    assert bytes(slot) == body
    assert not reader.mid_body


@pytest.mark.parametrize("step", [1, 40, 1 << 20])
def test_a_call_carries_its_method_and_message_and_may_be_longer_than_a_page(step):
    message = bytes(range(256)) * 40                     # 10 KiB: more than this reader's largest page
    body = memoryview(bytearray(len(message)))
    stream = tf.encode_call(7, message) + tf.encode_call(9, b"")
    events = feed(RequestReader(4096, memoryview(bytearray(64))), stream, step, [body])
    assert events == [Request(Op.CALL, len(message), 0, bytes(16), 7), Event.BODY_DONE,
                      Request(Op.CALL, 0, 0, bytes(16), 9)]
    assert bytes(body) == message
    with pytest.raises(ValueError, match="exceeds"):
        tf.encode_call(1, bytes(tf.CALL_BYTES_MAX + 1))
    reader = RequestReader(4096, memoryview(bytearray(8)))
    header = tf.REQUEST.pack(Op.CALL, tf.VERSION, 0, tf.CALL_BYTES_MAX + 1, 0, bytes(16), 1, 0)
    reader.buffer()[:len(header)] = header
    with pytest.raises(FrameError, match="a call of"):
        reader.received(len(header))


def test_a_refused_body_is_skipped_through_bounded_scratch_and_the_stream_stays_in_step():
    scratch = memoryview(bytearray(64))
    reader = RequestReader(4096, scratch)
    sizes = []
    buffer = reader.buffer
    reader.buffer = lambda: sizes.append(len(buffer())) or buffer()
    stream = tf.encode_request(Op.PUT, 5, TOKEN, 3, 1000) + b"x" * 1000 + tf.encode_request(Op.GET, 1, TOKEN, 2, 10)
    moved = []
    events = feed(reader, stream, 1 << 20, [None], moved)   # the body came with its header: moved on from there
    assert events[1] is Event.BODY_SKIPPED and events[2] == Request(Op.GET, 10, 1, TOKEN, 2)
    assert sum(moved) == 1000 and max(moved) <= len(scratch)
    assert max(sizes) <= max(len(scratch), tf.FRAMES_BYTES)


@pytest.mark.parametrize("step", [1000, 1 << 20])
def test_a_batch_of_requests_is_read_many_frames_at_a_time_and_taken_in_order(step):
    """100 GETs, then a PUT of a small page whose body comes in the same read as its header and the GETs after
    it: every request comes out once, in order, across reads that cut headers in two."""
    slot = memoryview(bytearray(448))
    body = bytes(range(224)) * 2
    gets = [tf.encode_request(Op.GET, 7, TOKEN, i, 448) for i in range(100)]
    stream = b"".join(gets) + tf.encode_request(Op.PUT, 8, TOKEN, 0, 448) + body + b"".join(gets[:3])
    reader = RequestReader(4096, memoryview(bytearray(64)))
    reads = []
    buffer = reader.buffer
    reader.buffer = lambda: reads.append(1) or buffer()
    events = feed(reader, stream, step, [slot])
    assert [e.slot for e in events[:100]] == list(range(100))
    assert events[100:] == [Request(Op.PUT, 448, 8, TOKEN, 0), Event.BODY_DONE] + [Request(Op.GET, 448, 7, TOKEN, i)
                                                                                  for i in range(3)]
    assert bytes(slot) == body
    assert len(reads) < 20   # a few buffers for 104 frames, not one each


def test_mid_body_is_reported_until_the_page_is_complete():
    slot = memoryview(bytearray(100))
    reader = RequestReader(4096, memoryview(bytearray(8)))
    header = tf.encode_request(Op.PUT, 1, TOKEN, 0, 100)
    reader.buffer()[:len(header)] = header
    request = reader.received(len(header))
    reader.accept_body(slot)
    reader.buffer()[:50] = b"y" * 50
    assert reader.received(50) is None and reader.mid_body
    reader.buffer()[:50] = b"y" * 50
    assert reader.received(50) is Event.BODY_DONE and not reader.mid_body
    assert request.lease_id == 1


@pytest.mark.parametrize("header, why", [
    (tf.REQUEST.pack(Op.PUT, 9, 0, 10, 1, TOKEN, 0, 0), "version"),
    (tf.REQUEST.pack(7, tf.VERSION, 0, 10, 1, TOKEN, 0, 0), "unknown data-plane op"),
    (tf.REQUEST.pack(Op.PUT, tf.VERSION, 0, 4097, 1, TOKEN, 0, 0), "exceeds the largest page"),
])
def test_unreadable_headers_are_frame_errors(header, why):
    reader = RequestReader(4096, memoryview(bytearray(8)))
    reader.buffer()[:len(header)] = header
    with pytest.raises(FrameError, match=why):
        reader.received(len(header))


def test_responses_round_trip_and_tokens_have_128_bits():
    assert tf.decode_response(tf.encode_response(0, Op.GET, 4096)) == (0, Op.GET, 4096, 0)
    assert tf.decode_response(tf.encode_response(0, Op.GET, 4096, tf.VOUCHED)).flags == tf.VOUCHED
    error = tf.encode_error(Op.PUT, 30, "no" * 1000)
    status, op, length, _ = tf.decode_response(error[:tf.RESPONSE.size])
    assert (status, op) == (30, Op.PUT) and length == tf.ERROR_TEXT_BYTES_MAX == len(error) - tf.RESPONSE.size
    assert tf.decode_response(tf.encode_error(0, 11, "closing")[:tf.RESPONSE.size])[0] == 11  # op 0: the stream is unreadable
    with pytest.raises(FrameError):
        tf.decode_response(tf.encode_response(0, 0, 0))
    with pytest.raises(ValueError, match="16 bytes"):
        tf.encode_request(Op.GET, 1, b"short", 0, 1)
    assert tf.TOKEN_BYTES * 8 >= 128


def test_a_completed_put_body_is_not_copied_out_of_its_slot():
    page_bytes = 4 << 20
    slot = memoryview(bytearray(page_bytes))
    reader = RequestReader(page_bytes, memoryview(bytearray(64)))
    header = tf.encode_request(Op.PUT, 5, TOKEN, 0, page_bytes)
    reader.buffer()[:len(header)] = header
    assert isinstance(reader.received(len(header)), Request)
    reader.accept_body(slot)
    tracemalloc.start()
    try:
        assert reader.received(len(reader.buffer())) is Event.BODY_DONE
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, f"completing a {page_bytes}-byte body allocated {peak} bytes"
