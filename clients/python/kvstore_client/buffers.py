"""Turn what callers hand us into page segments: a sequence of (address, nbytes) pairs per page.

Accepted, for put (read) and get (written):
  - one C-contiguous numpy array or CPU torch tensor holding n pages back to back;
  - a list with one entry per page, each a buffer (numpy array, torch tensor, bytes,
    bytearray, memoryview), a raw (pointer, nbytes) pair, or a list of such segments
    whose sizes add up to one page (K and V kept apart);
that is also what SGLang's zero-copy path hands a backend: host pointers and lengths.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import repeat
from typing import Any, Iterator, Union

import numpy as np

from kvstore_client.errors import InvalidArgument, PageSizeMismatch

Segment = tuple[int, int]


class PageRows(Sequence):
    """Pages back to back in one buffer: page i is the one segment (base + i * page_bytes, page_bytes).

    Sliced without copying, and a page's segments are made only as it is walked (in C: zip over a
    range), so a put of thousands of small pages builds no list of them up front.
    """

    __slots__ = ("base", "page_bytes", "count")

    def __init__(self, base: int, page_bytes: int, count: int):
        self.base, self.page_bytes, self.count = base, page_bytes, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(self.count)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return PageRows(self.base + start * self.page_bytes, self.page_bytes, max(0, stop - start))
        if index < 0:
            index += self.count
        if not 0 <= index < self.count:
            raise IndexError("page index out of range")
        return ((self.base + index * self.page_bytes, self.page_bytes),)

    def __iter__(self) -> Iterator[tuple[Segment]]:
        end = self.base + self.count * self.page_bytes
        return zip(zip(range(self.base, end, self.page_bytes), repeat(self.page_bytes)))

    def __repr__(self) -> str:
        return f"PageRows(base={self.base:#x}, page_bytes={self.page_bytes}, count={self.count})"


PageSegments = Union[PageRows, list[Sequence[Segment]]]


def page_buffer(pages: int, page_bytes: int) -> np.ndarray:
    """A (pages, page_bytes) uint8 array starting on a 4 KiB boundary, to put pages from and get them into.

    numpy's own large arrays (np.zeros, np.empty) start 16 bytes past a cache line, and a get writes a page with
    streamed stores of whole lines: into such an array the AVX2 and SSE2 copies go through a bounce buffer (gets
    of 1 MiB pages at 4.9 GB/s against 6.1 into this), and the AVX-512 copies put each line together from two
    stripes (5.5 against 6.2-6.4). torch's CPU tensors start on a line already. (glibc's memcpy, too, runs about
    half speed for 64 KiB copies between buffers that differ in alignment mod 64.)
    """
    if pages < 0 or page_bytes <= 0:
        raise InvalidArgument(f"a page buffer of {pages} pages of {page_bytes} bytes: pages >= 0, page_bytes > 0")
    raw = np.empty(pages * page_bytes + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start:start + pages * page_bytes].reshape(pages, page_bytes)


def page_segments(buffers: Any, pages: int, page_bytes: int, writable: bool) -> tuple[PageSegments, list[Any]]:
    """Segments of each page, and the objects that must stay alive while they are used."""
    keepalive: list[Any] = []
    if isinstance(buffers, PageRows) and buffers.page_bytes == page_bytes and len(buffers) == pages:
        return buffers, keepalive   # already checked, by the call that made them (a cluster's per-node piece)
    if _is_array_like(buffers):
        try:
            base, nbytes = _address(buffers, writable, keepalive)
        except InvalidArgument as exc:
            raise InvalidArgument(f"the pages' buffer: {exc}") from None
        if nbytes != pages * page_bytes:
            raise PageSizeMismatch(
                f"buffer holds {nbytes} bytes, expected {pages} pages x {page_bytes} bytes")
        return PageRows(base, page_bytes, pages), keepalive
    if len(buffers) != pages:
        raise InvalidArgument(f"got {len(buffers)} page buffers for {pages} keys")
    result = []
    for index, page in enumerate(buffers):
        try:
            segments = [_segment(s, writable, keepalive) for s in _as_segment_list(page)]
        except InvalidArgument as exc:
            raise InvalidArgument(f"page {index}: {exc}") from None
        total = sum(n for _, n in segments)
        if total != page_bytes:
            raise PageSizeMismatch(f"page {index} has {total} bytes, the namespace's pages have {page_bytes}")
        result.append(segments)
    return result, keepalive


def _as_segment_list(page: Any) -> Sequence[Any]:
    if isinstance(page, (list, tuple)) and not _is_pointer_pair(page):
        return page
    return [page]


def _is_pointer_pair(obj: Any) -> bool:
    return isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(v, int) for v in obj)


def _is_array_like(obj: Any) -> bool:
    return isinstance(obj, np.ndarray) or type(obj).__module__.startswith("torch")


def _segment(obj: Any, writable: bool, keepalive: list[Any]) -> Segment:
    if _is_pointer_pair(obj):
        address, nbytes = obj
        if address <= 0 or nbytes < 0:
            raise InvalidArgument(f"bad (pointer, nbytes) segment: {obj}")
        return address, nbytes
    return _address(obj, writable, keepalive)


def _address(obj: Any, writable: bool, keepalive: list[Any]) -> Segment:
    if type(obj).__module__.startswith("torch"):
        if obj.device.type != "cpu":
            raise InvalidArgument(f"tensor on {obj.device}: only CPU tensors can be copied over shared memory")
        if not obj.is_contiguous():
            raise InvalidArgument("tensor is not contiguous")
        keepalive.append(obj)
        return obj.data_ptr(), obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        array = obj
    else:
        try:
            view = memoryview(obj)
        except TypeError as exc:
            raise InvalidArgument(f"a page is a numpy array, CPU tensor, contiguous bytes-like buffer or (pointer, "
                                  f"nbytes) pair, got {type(obj).__name__} ({exc})") from None
        if _format_holds_objects(view.format):   # as an object array below; frombuffer would see bytes
            raise InvalidArgument(f"a {type(obj).__name__} of format {view.format!r} holds Python objects, not page "
                                  "bytes: use a buffer of a numeric format (bytes, bytearray, uint8, float16, ...)")
        if not view.c_contiguous:
            raise InvalidArgument(f"a {type(obj).__name__} that is not C-contiguous (a strided view): a page is a "
                                  "contiguous bytes-like buffer; pass a contiguous copy")
        array = np.frombuffer(view, dtype=np.uint8)
    if array.dtype.hasobject:   # its bytes are pointers to Python objects: a get would overwrite them
        raise InvalidArgument(f"an array of dtype {array.dtype} holds Python objects, not page bytes: "
                              "use a numeric dtype (uint8, float16, ...)")
    if not array.flags.c_contiguous:
        raise InvalidArgument("array is not C-contiguous")
    if writable and not array.flags.writeable:
        raise InvalidArgument("output buffer is read-only")
    keepalive.append(array)
    return array.ctypes.data, array.nbytes


def _format_holds_objects(fmt: str) -> bool:
    """Whether a buffer's struct format has an 'O' (a Python object pointer) field; field names, written
    between colons in a structured format ('T{d:a:O:b:}'), are not codes."""
    return "O" in re.sub(r":[^:]*:", "", fmt)
