"""How a put's or get's buffers become page segments, and how a run of pages is handed to a data path."""

import fcntl
import gc
import os
import threading

import numpy as np
import pytest

from kvstore_client import shared_buffers
from kvstore_client.buffers import PageRows, page_buffer, page_segments
from kvstore_client.data_path import PageColumns, offsets_and_segments
from kvstore_client.errors import InvalidArgument, PageSizeMismatch
from kvstore_client.shared_buffers import shared_page_buffer


def test_an_array_of_pages_is_described_by_its_base_and_is_walked_page_by_page():
    pages = np.zeros((6, 64), dtype=np.uint8)
    rows, _ = page_segments(pages, 6, 64, writable=False)
    base = pages.ctypes.data
    assert isinstance(rows, PageRows) and len(rows) == 6
    assert list(rows) == [((base + i * 64, 64),) for i in range(6)]
    assert rows[2] == ((base + 128, 64),) and rows[-1] == ((base + 320, 64),)
    with pytest.raises(IndexError):
        rows[6]


def test_a_slice_of_page_rows_is_the_same_pages_without_a_copy():
    base = np.zeros((8, 32), dtype=np.uint8)
    rows, _ = page_segments(base, 8, 32, writable=True)
    assert list(rows[3:6]) == list(rows)[3:6] and isinstance(rows[3:6], PageRows)
    assert list(rows[5:2]) == [] and list(rows[6:100]) == list(rows)[6:]
    assert list(rows[::3]) == list(rows)[::3]


def test_page_rows_pass_through_page_segments_only_for_the_same_pages():
    rows = PageRows(4096, 64, 3)
    assert page_segments(rows, 3, 64, writable=False)[0] is rows
    with pytest.raises(PageSizeMismatch):
        page_segments(rows, 3, 32, writable=False)     # walked as a list of pages, each of 64 bytes


def test_an_array_of_the_wrong_size_is_refused():
    with pytest.raises(PageSizeMismatch, match="expected 4 pages x 64 bytes"):
        page_segments(np.zeros((3, 64), dtype=np.uint8), 4, 64, writable=False)


def test_page_columns_walk_as_page_triples_and_give_their_offsets_and_segments():
    base = 1 << 20
    rows = PageRows(base, 16, 3)
    columns = PageColumns(range(5, 8), [0, 16, 48], rows)
    assert len(columns) == 3
    assert list(columns) == [(5, 0, ((base, 16),)), (6, 16, ((base + 16, 16),)), (7, 48, ((base + 32, 16),))]
    assert offsets_and_segments(columns) == ([0, 16, 48], rows)
    assert offsets_and_segments(list(columns)) == ([0, 16, 48], list(rows))


@pytest.mark.parametrize("writable", [True, False])
def test_an_array_of_python_objects_is_refused_before_any_copy(writable):
    """Its bytes are pointers: a get writing page bytes over them would crash the client."""
    objects = np.empty((2, 4096 // np.dtype(object).itemsize), dtype=object)
    with pytest.raises(InvalidArgument, match="holds Python objects"):
        page_segments(objects, 2, 4096, writable)
    with pytest.raises(InvalidArgument, match="holds Python objects"):
        page_segments(list(objects), 2, 4096, writable)


def test_a_buffer_that_is_not_contiguous_is_an_invalid_argument():
    strided = memoryview(bytearray(8192))[::2]
    with pytest.raises(InvalidArgument, match="page 0: .*not C-contiguous"):
        page_segments([strided], 1, 4096, writable=True)


@pytest.mark.parametrize("pages, page_bytes", [(3, 4096), (5, 100), (1, 1 << 20)])
def test_a_page_buffer_starts_on_a_4k_boundary_and_holds_its_pages_as_rows(pages, page_bytes):
    buffer = page_buffer(pages, page_bytes)
    assert buffer.shape == (pages, page_bytes) and buffer.dtype == np.uint8 and buffer.flags.c_contiguous
    assert buffer.ctypes.data % 4096 == 0
    rows, _ = page_segments(buffer, pages, page_bytes, writable=True)
    assert list(rows) == [((buffer.ctypes.data + i * page_bytes, page_bytes),) for i in range(pages)]


@pytest.mark.parametrize("pages, page_bytes", [(-1, 64), (2, 0)])
def test_a_page_buffer_of_no_size_is_an_invalid_argument(pages, page_bytes):
    with pytest.raises(InvalidArgument, match="page_bytes > 0"):
        page_buffer(pages, page_bytes)


@pytest.mark.parametrize("pages, page_bytes", [(3, 4096), (5, 100), (2, 1 << 20)])
def test_a_shared_page_buffer_is_a_sealed_filled_memfd_found_by_its_pages(pages, page_bytes):
    buffer = shared_page_buffer(pages, page_bytes)
    assert buffer.shape == (pages, page_bytes) and buffer.dtype == np.uint8 and buffer.ctypes.data % 4096 == 0
    rows, held = page_segments(buffer, pages, page_bytes, writable=True)
    shared, offsets = shared_buffers.holding(rows, page_bytes)
    assert offsets.tolist() == [shared_buffers.HEADER_BYTES + i * page_bytes for i in range(pages)]
    assert shared_buffers.holding(page_segments(page_buffer(pages, page_bytes), pages, page_bytes, True)[0],
                                  page_bytes) is None
    info = os.fstat(shared.fd)
    assert info.st_size % 4096 == 0 and info.st_blocks * 512 >= info.st_size
    assert fcntl.fcntl(shared.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
    del buffer, rows, held, offsets   # the last view of the mapping: the buffer is released
    gc.collect()
    assert shared.released and shared not in shared_buffers.live_buffers()


def test_a_shared_buffer_released_by_the_collector_while_its_thread_looks_up_buffers_does_not_hang_it():
    """The garbage collector runs a dead buffer's release at any allocation, in whichever thread allocates: here
    while that thread holds the lock of the buffers' table (as holding() does), which the release must not wait on."""
    def release_inside_the_lock(done: list) -> None:
        buffer = shared_page_buffer(2, 4096)
        shared, _ = shared_buffers.holding(page_segments(buffer, 2, 4096, True)[0], 4096)
        cycle = [buffer]
        cycle.append(cycle)   # only the collector frees it
        del buffer, cycle
        with shared_buffers._live_lock:
            gc.collect()
        done.append(shared)

    done: list = []
    thread = threading.Thread(target=release_inside_the_lock, args=(done,), daemon=True)
    thread.start()
    thread.join(10)
    assert done, "the release waited on the lock its own thread held"
    assert done[0].released and done[0].fd == -1 and done[0] not in shared_buffers.live_buffers()


@pytest.mark.parametrize("pages, page_bytes", [(0, 64), (2, 0)])
def test_a_shared_page_buffer_of_no_size_is_an_invalid_argument(pages, page_bytes):
    with pytest.raises(InvalidArgument, match="both positive"):
        shared_page_buffer(pages, page_bytes)
