"""The store's page-event journal announces each (page, tier) change once, numbers batches per tenant, and makes
every loss it must take (a full queue) a visible gap."""

from kvstore.control.index import NO_SLOT, PageRecord
from kvstore.control.store_events import CLEARED, REMOVED, STORED, StoreEvents, topic_of


def record(key: bytes, parent=None, dram=True, nvme=False, tenant="t") -> PageRecord:
    r = PageRecord((1, key), parent, 0 if dram else NO_SLOT, 4096, 0)
    r.on_nvme, r.tenant, r.alive, r.anchor = nvme, tenant, True, b""
    return r


def kinds(batches):
    return [(e.kind, e.medium, e.key) for b in batches for e in b.events]


def test_each_tier_change_is_announced_once_with_its_parent():
    journal = StoreEvents(batch_events_max=4, queue_pages_max=100, page_tokens_of=lambda ns: 16)
    root = record(b"a")
    child = record(b"b", parent=root)
    journal.sync([root, child, root])          # a page named twice is announced once
    batches = journal.take()
    assert [b.seq for b in batches] == [0]
    assert kinds(batches) == [(CLEARED, "", b""), (STORED, "CPU", b"a"), (STORED, "CPU", b"b")]
    assert batches[0].events[2].parent_key == b"a" and batches[0].events[2].page_tokens == 16
    root.on_nvme = True                        # written down
    journal.sync([root, child])
    journal.dram_dropped(root)                 # its DRAM copy goes (the index clears the offset after the call)
    child.alive = False                        # removed
    journal.sync([child])
    assert kinds(journal.take()) == [(STORED, "DISK", b"a"), (REMOVED, "CPU", b"a"), (REMOVED, "CPU", b"b")]
    assert journal.take() == []


def test_streams_are_per_tenant_and_numbered_from_zero():
    journal = StoreEvents(batch_events_max=2, queue_pages_max=100)
    journal.sync([record(b"x%d" % i, tenant="t1") for i in range(3)] + [record(b"y", tenant="t2")])
    batches = journal.take()
    assert [(b.tenant, b.seq, len(b.events)) for b in batches] == [("t1", 0, 2), ("t1", 1, 2), ("t2", 0, 2)]
    assert journal.snapshot_seq("t1") == 2 and journal.snapshot_seq("t3") == 0
    assert topic_of("a") != topic_of("a/b") and not topic_of("a/b").startswith(topic_of("a"))


def test_a_full_queue_drops_waiting_events_and_skips_a_number():
    journal = StoreEvents(batch_events_max=8, queue_pages_max=8)
    journal.sync([record(b"k%d" % i) for i in range(4)])
    assert [b.seq for b in journal.take()] == [0]
    journal.sync([record(b"m%d" % i) for i in range(20)])   # past the queue's bound
    assert journal.dropped > 0
    first = journal.snapshot_seq("t")        # no event appended from here on can be numbered lower
    assert first == 1 + 2                     # two drops (20 events through a queue of 8): numbers 1 and 2 lost
    batches = journal.take()
    assert batches and batches[0].seq == first   # the lost numbers are never published: a gap a consumer sees
