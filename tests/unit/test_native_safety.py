"""kvstore_native survives hostile arguments: lists changed by Python code it calls, reentrant calls,
an uninitialised index, values past its fields' widths, and page buffers that are not plain bytes.

A call that used to crash the process runs in a child interpreter (same PYTHONPATH), so a segfault
fails the test instead of killing pytest; the child prints what it saw and must exit 0.
"""

import ctypes
import gc
import os
import subprocess
import sys
import textwrap
import time
import weakref

import numpy as np
import pytest

from kvstore_client.buffers import page_segments
from kvstore_client.cluster import parse_cluster_url
from kvstore_client.errors import InvalidArgument
from kvstore_client.etcd import parse_endpoint

try:
    import kvstore_native
except ImportError:
    kvstore_native = None

needs_native = pytest.mark.skipif(kvstore_native is None, reason="kvstore_native is not built (or turned off)")


def run_child(code: str) -> str:
    """Run `code` in a fresh interpreter; assert it exits 0 and return what it printed."""
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", ""), PYTHONFAULTHANDLER="1")
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True)
    assert child.returncode == 0, f"child exited {child.returncode}\nstdout:\n{child.stdout}\nstderr:\n{child.stderr}"
    return child.stdout


INDEX_PRELUDE = """
import kvstore_native
removed = []
index = kvstore_native.PageIndex(removed.append, lambda record: None)
"""


# ---------------------------------------------------------------- lists changed mid-call (module.c)

@needs_native
def test_copy_hash_reads_its_segments_from_a_copy_when_a_length_clears_the_list():
    out = run_child("""
        import ctypes, kvstore_native
        source = ctypes.create_string_buffer(b"abcdefgh", 8)
        dst = ctypes.create_string_buffer(8)
        segments = []
        class Length:
            def __index__(self):
                segments.clear()   # drops the pairs the call is reading
                return 4
        segments += [(ctypes.addressof(source), Length()), (ctypes.addressof(source) + 4, 4)]
        kvstore_native.copy_hash(ctypes.addressof(dst), segments)
        print("copied", dst.raw)
    """)
    assert "copied b'abcdefgh'" in out


@needs_native
def test_copy_hash_pages_reads_its_pages_from_a_copy_when_a_length_clears_the_list():
    out = run_child("""
        import ctypes, kvstore_native
        source = ctypes.create_string_buffer(b"abcdefgh", 8)
        slab = ctypes.create_string_buffer(16)
        pages = []
        class Length:
            def __index__(self):
                pages.clear()
                return 8
        pages += [(0, [(ctypes.addressof(source), Length())]), (8, [(ctypes.addressof(source), 8)])]
        sums = kvstore_native.copy_hash_pages(ctypes.addressof(slab), pages)
        print("pages", len(sums), slab.raw)
    """)
    assert "pages 2 b'abcdefghabcdefgh'" in out


@needs_native
def test_xxh3_kernel_reads_its_cuts_from_a_copy_when_a_cut_clears_the_list():
    out = run_child("""
        import kvstore_native
        data = bytes(range(200))
        cuts = []
        class Cut:
            def __index__(self):
                cuts.clear()
                return 50
        cuts += [Cut(), 100, 150]
        streamed = kvstore_native.xxh3_64_kernel(data, "scalar", cuts)
        print("same", streamed == kvstore_native.xxh3_64(data))
    """)
    assert "same True" in out


# ---------------------------------------------------------------- lists changed mid-call (the page index)

@needs_native
def test_add_chain_keeps_its_keys_when_an_offset_clears_the_list():
    out = run_child(INDEX_PRELUDE + """
keys = [b"k" * 40 + bytes([i]) for i in range(8)]   # long keys: held by pointer, not copied inline
class Offset:
    def __index__(self):
        keys.clear()
        return 0
added = index.add_chain(1, keys, None, [Offset()] + list(range(1, 8)), 4096, list(range(8)), records=False)
index.check_prefix_closed()
print("added", added, len(index), index.get((1, b"k" * 40 + bytes([7]))).offset)
""")
    assert "added 8 8 7" in out


@needs_native
def test_add_chain_refuses_offsets_that_change_while_it_reads_them():
    out = run_child(INDEX_PRELUDE + """
offsets = []
class Offset:
    def __index__(self):
        offsets.clear()
        return 0
offsets += [Offset(), 1, 2]
try:
    index.add_chain(1, [b"a", b"b", b"c"], None, offsets, 4096, [0, 1, 2])
except RuntimeError as exc:
    print("refused:", exc, len(index))
""")
    assert "refused: add_chain's lists changed while it read them 0" in out


@needs_native
def test_leading_reads_its_keys_after_the_namespace_id_runs_python_code():
    out = run_child(INDEX_PRELUDE + """
class Namespace:
    def __hash__(self):
        return 7
    def __eq__(self, other):
        keys.clear()   # while the namespace is looked up
        return isinstance(other, Namespace)
index.add_chain(Namespace(), [b"a", b"b"], None, [0, 1], 4096, [0, 0])
keys = [b"a", b"b"] * 1000   # an equal namespace id, not the same object: __eq__ runs
print("leading", len(index.leading(Namespace(), keys)))
keys = [b"a", b"b"] * 1000
print("held", len(index.positions_held(Namespace(), keys)))
""")
    assert "leading 0" in out and "held 0" in out


@needs_native
def test_unpin_all_survives_an_on_removed_callback_that_clears_its_list():
    out = run_child("""
import kvstore_native
records = []
index = kvstore_native.PageIndex(lambda record: records.clear(), lambda record: None)
pages = [index.add((1, bytes([i])), None, i, 4096, 0) for i in range(4)]
for record in pages:
    index.pin(record)
    index.remove_subtree(record)
records += pages
del pages
index.unpin_all(records)
print("unpinned")
""")
    assert "unpinned" in out


@needs_native
@pytest.mark.parametrize("where", ["tenant_of", "namespace __hash__", "on_removed"])
def test_a_callback_that_calls_back_into_the_index_is_refused(where):
    out = run_child(f"""
import kvstore_native
where = {where!r}
def reenter(*args):
    index.add((9, b"inner"), None, 0, 4096, 0)
    return ""
class Namespace:
    def __hash__(self):
        if where == "namespace __hash__":
            reenter()
        return 1
    def __eq__(self, other):
        return self is other
index = kvstore_native.PageIndex(reenter if where == "on_removed" else (lambda record: None), lambda record: None,
                                 reenter if where == "tenant_of" else None)
try:
    if where == "on_removed":
        index.remove_subtree(index.add((1, b"a"), None, 0, 4096, 0))
    else:
        index.add((Namespace(), b"a"), None, 0, 4096, 0)
except RuntimeError as exc:
    print("refused:", exc)
index.check_prefix_closed()
print("inner page added:", (9, b"inner") in index)
""")
    assert "refused: PageIndex called from within one of its own calls" in out
    assert "inner page added: False" in out


# ---------------------------------------------------------------- an index without __init__, and the collector

@needs_native
def test_an_index_made_without_init_refuses_every_call():
    out = run_child("""
import kvstore_native
index = kvstore_native.PageIndex.__new__(kvstore_native.PageIndex)
calls = [lambda: index.get((1, b"a")), lambda: (1, b"a") in index, lambda: index.scan(0, 16),
         lambda: index.add((1, b"a"), None, 0, 4096, 0), lambda: index.check_prefix_closed(),
         lambda: index.evict_dram(None, False)]
for call in calls:
    try:
        call()
    except RuntimeError as exc:
        print("refused:", exc)
print("len", len(index))
""")
    assert out.count("refused: PageIndex is not initialised") == 6 and "len 0" in out


@needs_native
def test_an_index_holding_an_anchored_root_is_collected():
    class Index(kvstore_native.PageIndex):   # a Python subclass, so a weak reference can watch it
        pass

    index = Index(lambda record: None, lambda record: None)
    index.add((1, b"child"), None, 0, 4096, 0, anchor=b"absent parent")   # index -> anchors -> record -> index
    watch = weakref.ref(index)
    del index
    # gc.collect() does nothing while a collection runs in another thread (one can be under way in a thread an
    # earlier test left, its finalizers holding it open): ask again, a bounded number of times.
    for _ in range(100):
        gc.collect()
        if watch() is None:
            break
        time.sleep(0.01)
    assert watch() is None


# ---------------------------------------------------------------- values past the fields' widths

@needs_native
def test_values_past_the_native_fields_are_refused_not_truncated():
    index = kvstore_native.PageIndex(lambda record: None, lambda record: None)
    index.add((1, b"k" * 255), None, 0, 4096, 2**64 - 1)
    assert index.get((1, b"k" * 255)).checksum == 2**64 - 1
    with pytest.raises(ValueError, match="at most 255 bytes, got 256"):
        index.add((1, b"k" * 256), None, 0, 4096, 0)
    with pytest.raises(OverflowError, match=r"slot_bytes must be in 0\.\.4294967295, got 4294967296"):
        index.add((1, b"s"), None, 0, 2**32, 0)
    for checksum in (2**64, -1):
        with pytest.raises(OverflowError, match=r"checksum must be in 0\.\.18446744073709551615"):
            index.add((1, b"c"), None, 0, 4096, checksum)
    with pytest.raises(ValueError, match="at most 255 bytes"):
        index.add_chain(2, [b"a", b"b" * 300], None, [0, 1], 4096, [0, 0])
    with pytest.raises(OverflowError, match="slot_bytes"):
        index.add_chain(3, [b"a"], None, [0], 2**40, [0])
    with pytest.raises(OverflowError, match="checksum"):
        index.add_chain(3, [b"a"], None, [0], 4096, [2**70])
    assert len(index) == 2 and (3, b"a") not in index and (1, b"s") not in index   # b"a" of namespace 2 is in
    index.check_prefix_closed()


# ---------------------------------------------------------------- errors of the right type

@needs_native
def test_a_segment_that_is_not_a_tuple_is_a_type_error():
    source = ctypes.create_string_buffer(8)
    dst = ctypes.create_string_buffer(8)
    with pytest.raises(TypeError, match=r"a segment is an \(address, nbytes\) tuple, not list"):
        kvstore_native.copy_hash(ctypes.addressof(dst), [[ctypes.addressof(source), 8]])
    with pytest.raises(TypeError, match=r"a page is an \(offset, segments\) tuple, not list"):
        kvstore_native.copy_hash_pages(ctypes.addressof(dst), [[0, [(ctypes.addressof(source), 8)]]])
    with pytest.raises(TypeError, match="segments must be a list"):
        kvstore_native.copy_hash(ctypes.addressof(dst), 5)


def test_a_strided_page_buffer_is_an_invalid_argument_naming_the_page():
    pages = [bytearray(4096), memoryview(bytearray(8192))[::2]]
    with pytest.raises(InvalidArgument, match="page 1: a memoryview that is not C-contiguous"):
        page_segments(pages, 2, 4096, writable=True)


@pytest.mark.parametrize("url", ["etcd://[::1/prod", "etcd://h1:abc/prod", "etcd://h1:2379,h2:99999/prod"])
def test_a_bad_cluster_url_is_an_invalid_argument(url):
    with pytest.raises(InvalidArgument, match="must look like"):
        parse_cluster_url(url)


@pytest.mark.parametrize("endpoint", ["[::1", "h1:abc", "h1:70000", "https://[zz]:2379"])
def test_a_bad_etcd_endpoint_is_an_invalid_argument(endpoint):
    with pytest.raises(InvalidArgument, match="must look like host:port"):
        parse_endpoint(endpoint)


# ---------------------------------------------------------------- buffers of Python objects

def _object_buffers():
    objects = np.empty(512, dtype=object)
    structured = np.zeros(256, dtype=[("value", "<f8"), ("Owner", "O")])   # a field name with an 'O' too
    return {
        "memoryview of format O": memoryview(objects),
        "ctypes array of py_object": (ctypes.py_object * 512)(),
        "memoryview of a structured dtype with an object": memoryview(structured),
        "structured array with an object": structured,
        "object array": objects,
    }


@pytest.mark.parametrize("writable", [True, False])
@pytest.mark.parametrize("kind", list(_object_buffers()))
def test_a_buffer_of_python_objects_is_refused_before_any_copy(kind, writable):
    buffer = _object_buffers()[kind]
    with pytest.raises(InvalidArgument, match="page 0: .*holds Python objects"):
        page_segments([buffer], 1, 4096, writable)
    with pytest.raises(InvalidArgument, match="page 0: .*holds Python objects"):
        page_segments([[buffer]], 1, 4096, writable)   # as a page's one segment


def test_a_structured_buffer_without_objects_is_still_a_page():
    structured = np.zeros(256, dtype=[("Offset", "<f8"), ("Other", "<u8")])
    segments, _ = page_segments([memoryview(structured)], 1, 4096, writable=True)
    assert segments == [[(structured.ctypes.data, 4096)]]
