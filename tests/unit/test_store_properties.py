"""Random runs of the page store's verbs against a model: every page served holds its own bytes, no DRAM
slot has two owners, pages stay prefix-closed, pages on NVMe survive a crash-restart, and nothing
stays leased, pinned or claimed once every lease has ended.

The store is driven as the service drives it (KVStoreService's methods with their requests), with
the controller's moves (write-down, promotion, its background pass) called in the test's thread, on
a small arena so that eviction and refusals are common. The budget is fixed and the runs derandomized
(the same examples every time); KVSTORE_PROPERTY_EXAMPLES runs more of them (`make crash`).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import tempfile

import pytest
import xxhash
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvstore import failpoints
from kvstore.control import native_index, recovery
from kvstore.control.index import NO_SLOT
from kvstore_client import errors
from kvstore_client.keys import Namespace
from kvstore_client.proto import pb
from node_parts import ManualClock, make_node

EXAMPLES = int(os.environ.get("KVSTORE_PROPERTY_EXAMPLES", "25"))
STEPS = 100
DEPTH = 4                     # keys are paths of 1..DEPTH bits: a binary tree of 30 pages a namespace
ALICE_NVME_BYTES = 128 << 10  # alice's NVMe quota: her pages are evicted from NVMe too; bob's never are
NODE = ["dram.arena_bytes=1MiB", "dram.slab_bytes=256KiB", "limits.page_bytes_max=64KiB", "nvme.map_bytes=64MiB",
        "leases.per_tenant_max=6", f"tenants.quotas=alice:0:{ALICE_NVME_BYTES},bob:{768 << 10}:0"]
# (tenant, page bytes): several sizes, one not a multiple of the slot alignment.
NAMESPACES = [("alice", 4096), ("alice", 20000), ("bob", 8192), ("bob", 65536)]


class Connection:
    """A caller the store ends leases with; `arena` set: a local one that maps the arena (its write
    leases' slots are fenced when they end without it)."""

    def __init__(self, arena: str | None):
        self.arena = arena


def key_of(path: tuple[int, ...]) -> bytes:
    return b"p" + bytes(48 + bit for bit in path)


def path_of(key: bytes) -> tuple[int, ...]:
    return tuple(byte - 48 for byte in key[1:])


def parent_of(key: bytes) -> bytes:
    return key[:-1] if len(key) > 2 else b""


_contents: dict[tuple[int, bytes, int], bytes] = {}


def content(ns_id: int, key: bytes, page_bytes: int) -> bytes:
    """A page's bytes, derived from its identity: the model knows what every page must hold."""
    found = _contents.get((ns_id, key, page_bytes))
    if found is None:
        seed = hashlib.sha256(ns_id.to_bytes(8, "little") + key).digest()
        found = _contents[(ns_id, key, page_bytes)] = (seed * (page_bytes // len(seed) + 1))[:page_bytes]
    return found


class WriteLease:
    def __init__(self, lease_id: int, ns: int, keys: list[bytes], parent: bytes, owner: Connection):
        self.lease_id, self.ns, self.keys, self.parent, self.owner = lease_id, ns, keys, parent, owner
        self.slots: dict[int, int] = {}      # index -> offset, reserved and not committed


class ReadLease:
    def __init__(self, lease_id: int, ns: int, keys: list[bytes], offsets: list[int], owner: Connection):
        self.lease_id, self.ns, self.keys, self.offsets, self.owner = lease_id, ns, keys, offsets, owner


# Mostly 0s: chains share prefixes and runs meet the pages earlier steps put.
paths = st.lists(st.sampled_from([0, 0, 0, 1]), min_size=1, max_size=DEPTH).map(tuple)
picks = st.integers(0, 1 << 16)


class StoreMachine(RuleBasedStateMachine):
    policy = "write_through"
    native = "false"

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvstore-props-")
        self.clock = ManualClock()
        self.conns = [Connection(None), Connection("local")]
        self.node = None
        self.start_node()
        # The model: pages that may be held (committed, not deleted, not lost to a restart), and pages
        # known to be on NVMe (a durable commit or a write-down said so) that nothing deleted since.
        self.may_hold: set[tuple[int, bytes]] = set()
        self.durable: set[tuple[int, bytes]] = set()
        self.writes: dict[int, WriteLease] = {}
        self.reads: dict[int, ReadLease] = {}
        self.fenced: dict[int, tuple[Connection, list[int]]] = {}

    # -- the node ------------------------------------------------------------------------

    def start_node(self) -> None:
        overrides = [*NODE, f"controller.write_policy={self.policy}", f"server.native_index={self.native}"]
        self.node = make_node(pathlib.Path(self.dir), overrides, self.clock)
        self.ns = []
        for i, (tenant, page_bytes) in enumerate(NAMESPACES):
            spec = Namespace(model=f"m{i}", page_bytes=page_bytes, tenant=tenant).to_proto()
            ns_id = self.node.open_namespace(pb.OpenNamespaceRequest(spec=spec), None).namespace_id
            self.ns.append((ns_id, tenant, page_bytes))

    def teardown(self) -> None:
        if self.node is not None:
            try:
                self.end_everything()
            finally:
                self.node.nvme.close()
                self.node.store.arena.close()
                shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def store(self):
        return self.node.store

    def page_bytes_of(self, ns_id: int) -> int:
        return next(p for i, _, p in self.ns if i == ns_id)

    def tenant_of(self, ns_id: int) -> str:
        return next(t for i, t, _ in self.ns if i == ns_id)

    def aim(self, ns_id: int, path: tuple[int, ...], pick: int) -> tuple[int, ...]:
        """Mostly a path through a page put before (then on past it), at times the path as drawn."""
        known = sorted(key for ns, key in self.may_hold if ns == ns_id)
        if not known or pick % 3 == 2:
            return path
        return (path_of(known[pick % len(known)]) + path)[:DEPTH]

    def held(self, ns_id: int, key: bytes) -> bool:
        return self.store.index.get((ns_id, key)) is not None

    def claimed(self) -> dict[tuple[int, bytes], int]:
        return {(lease.ns, lease.keys[i]): lease.lease_id for lease in self.writes.values() for i in lease.slots}

    def note_durable(self, ns_id: int, keys: list[bytes]) -> None:
        for key in keys:
            assert (ns_id, key) in self.may_hold, "a page reached NVMe that was never committed"
            self.durable.add((ns_id, key))

    # -- writes --------------------------------------------------------------------------

    @rule(ns=st.integers(0, len(NAMESPACES) - 1), path=paths, start=picks, conn=st.integers(0, 1))
    def reserve(self, ns, path, start, conn):
        self.reserve_pages(ns, path, start, conn)

    @rule(ns=st.integers(0, len(NAMESPACES) - 1), path=paths, start=picks, conn=st.integers(0, 1),
          durable=st.booleans())
    def put(self, ns, path, start, conn, durable):
        """Reserve and commit at once, as most puts do."""
        lease = self.reserve_pages(ns, path, start, conn)
        if lease is not None:
            self.commit_pages(lease, [], True, durable)

    def reserve_pages(self, ns, path, start, conn) -> WriteLease | None:
        ns_id, _, page_bytes = self.ns[ns]
        path = self.aim(ns_id, path, start)
        leading = len(self.store.index.leading(ns_id, [key_of(path[:d]) for d in range(1, len(path) + 1)]))
        # Mostly under the deepest page held on the path (as an engine puts a prompt's new pages), at
        # times anywhere: under an absent parent, or over pages already held.
        start = start % len(path) if start % 4 == 3 else min(leading, len(path) - 1)
        keys = [key_of(path[:depth]) for depth in range(start + 1, len(path) + 1)]
        parent = key_of(path[:start]) if start else b""
        claimed_before = self.claimed()
        parent_known = not parent or self.held(ns_id, parent) or (ns_id, parent) in claimed_before
        request = pb.ReserveRequest(namespace_id=ns_id, keys=keys, parent_key=parent, page_bytes=page_bytes)
        try:
            r = self.node.reserve(request, self.conns[conn])
        except errors.CapacityExhausted:
            return None
        if not r.lease_id:
            assert all(s in (pb.PARENT_MISSING, pb.PRESENT, pb.IN_FLIGHT, pb.NO_SPACE) for s in r.states)
            if all(s == pb.PARENT_MISSING for s in r.states):
                assert not parent_known, "a Reserve under a held or claimed parent was refused"
            return None
        assert parent_known, "a Reserve under an absent parent got a lease"
        lease = self.writes[r.lease_id] = WriteLease(r.lease_id, ns_id, list(keys), parent, self.conns[conn])
        self.take_slots(lease, 0, r, claimed_before)
        return lease

    @precondition(lambda self: any(len(lease.keys[-1]) - 1 < DEPTH for lease in self.writes.values()))
    @rule(pick=picks, more=paths)
    def extend(self, pick, more):
        leases = [lease for lease in self.writes.values() if len(lease.keys[-1]) - 1 < DEPTH]
        lease = leases[pick % len(leases)]
        path = path_of(lease.keys[-1])
        more = more[:DEPTH - len(path)]
        keys = [key_of(path + more[:i]) for i in range(1, len(more) + 1)]
        claimed_before = self.claimed()
        request = pb.ReserveRequest(namespace_id=lease.ns, keys=keys, parent_key=lease.keys[-1], lease_id=lease.lease_id,
                                    page_bytes=self.page_bytes_of(lease.ns))
        r = self.node.reserve(request, lease.owner)
        assert r.lease_id == lease.lease_id and r.first_index == len(lease.keys)
        first = len(lease.keys)
        lease.keys += keys
        self.take_slots(lease, first, r, claimed_before)

    def take_slots(self, lease: WriteLease, first: int, r: pb.ReserveResponse, claimed_before: dict) -> None:
        """Check a Reserve's answer against the model and write each reserved slot its page's bytes."""
        page_bytes = self.page_bytes_of(lease.ns)
        view = self.store.arena.view
        for i, (state, offset) in enumerate(zip(r.states, r.offsets)):
            key = lease.keys[first + i]
            if state == pb.RESERVED:
                assert (lease.ns, key) not in claimed_before, "a key was reserved by two leases at once"
                lease.slots[first + i] = offset
                view[offset:offset + page_bytes] = content(lease.ns, key, page_bytes)
            elif state == pb.IN_FLIGHT:
                assert (lease.ns, key) in claimed_before, "a key no lease holds was said to be in flight"
            elif state == pb.PRESENT:
                assert (lease.ns, key) in self.may_hold, "a page never committed was said to be present"
            else:
                assert state == pb.NO_SPACE, state
        if not lease.slots and first == 0:
            raise AssertionError("a lease with no slot was answered")

    @precondition(lambda self: self.writes)
    @rule(pick=picks, how=st.sampled_from(["all", "first", "some"]), sums=st.booleans(), durable=st.booleans(),
          chosen=st.lists(st.booleans(), min_size=DEPTH * 2, max_size=DEPTH * 2))
    def commit(self, pick, how, sums, durable, chosen):
        lease = list(self.writes.values())[pick % len(self.writes)]
        ordered = sorted(lease.slots)
        if how == "all":
            indices = []
        elif how == "first":
            indices = ordered[:1]
        else:
            indices = [i for i, take in zip(ordered, chosen) if take] or ordered[-1:]
        self.commit_pages(lease, indices, sums, durable)

    def commit_pages(self, lease: WriteLease, indices: list[int], sums: bool, durable: bool) -> None:
        named = indices or sorted(lease.slots)
        page_bytes = self.page_bytes_of(lease.ns)
        checksums = [xxhash.xxh3_64_intdigest(content(lease.ns, lease.keys[i], page_bytes)) for i in named]
        # What publishing in chain order must do: a page whose parent is neither held nor published
        # just before it by this commit is dropped.
        expected, visible = [], set()
        for i in named:
            parent = lease.keys[i - 1] if i else lease.parent
            ok = not parent or parent in visible or self.held(lease.ns, parent)
            expected.append(pb.COMMITTED if ok else pb.COMMIT_PARENT_MISSING)
            if ok:
                visible.add(lease.keys[i])
        request = pb.CommitRequest(lease_id=lease.lease_id, indices=indices, checksums=checksums if sums else [],
                                   durable=durable)
        r = self.node.commit(request, lease.owner)
        assert list(r.states) == expected
        assert list(r.checksums) == checksums, "a committed slot does not hold what its writer wrote"
        committed = [lease.keys[i] for i, state in zip(named, r.states) if state == pb.COMMITTED]
        for i in named:
            del lease.slots[i]
        for key in committed:
            self.may_hold.add((lease.ns, key))
        if not durable:
            for key in committed:
                assert self.held(lease.ns, key), "a committed page is not in the store"
        self.note_durable(lease.ns, committed[:r.durable_pages])
        if not lease.slots:
            del self.writes[lease.lease_id]
            assert self.store.leases.get(lease.lease_id) is None, "a lease with every page committed is open"

    @precondition(lambda self: self.writes or self.fenced)
    @rule(pick=picks, by_owner=st.booleans())
    def abort(self, pick, by_owner):
        ids = [*self.writes, *self.fenced]   # in the order they were opened: lease ids are random
        lease_id = ids[pick % len(ids)]
        if lease_id in self.fenced:
            owner, _ = self.fenced.pop(lease_id)
            assert self.node.abort(pb.AbortRequest(lease_id=lease_id), owner).aborted_pages == 0
            return
        lease = self.writes.pop(lease_id)
        owner = lease.owner if by_owner else next(c for c in self.conns if c is not lease.owner)
        assert self.node.abort(pb.AbortRequest(lease_id=lease_id), owner).aborted_pages == len(lease.slots)
        if owner is not lease.owner and lease.owner.arena is not None and lease.slots:
            self.fenced[lease_id] = (lease.owner, list(lease.slots.values()))

    # -- reads ---------------------------------------------------------------------------

    @rule(ns=st.integers(0, len(NAMESPACES) - 1), path=paths, pick=picks, conn=st.integers(0, 1),
          policy=st.sampled_from([pb.WAIT_COMPLETE, pb.BEST_EFFORT]))
    def acquire(self, ns, path, pick, conn, policy):
        ns_id, _, page_bytes = self.ns[ns]
        path = self.aim(ns_id, path, pick)
        keys = [key_of(path[:depth]) for depth in range(1, len(path) + 1)]
        request = pb.AcquireRequest(namespace_id=ns_id, keys=keys, policy=policy)
        try:
            a = self.node.acquire(request, self.conns[conn])
        except errors.CapacityExhausted:
            return
        view = self.store.arena.view
        for key, offset, checksum in zip(keys, a.offsets, a.checksums):
            assert (ns_id, key) in self.may_hold, "a page never committed, or deleted, was served"
            assert bytes(view[offset:offset + page_bytes]) == content(ns_id, key, page_bytes), \
                f"a page was served with another page's bytes: {key!r}"
            assert checksum == xxhash.xxh3_64_intdigest(content(ns_id, key, page_bytes))
        assert a.hit_pages == len(a.offsets)
        if a.lease_id:
            self.reads[a.lease_id] = ReadLease(a.lease_id, ns_id, keys[:a.hit_pages], list(a.offsets), self.conns[conn])

    @precondition(lambda self: self.reads)
    @rule(pick=picks)
    def release(self, pick):
        lease_id = list(self.reads)[pick % len(self.reads)]
        del self.reads[lease_id]
        assert self.node.release(pb.ReleaseRequest(lease_ids=[lease_id]), None).released == 1

    @rule(conn=st.integers(0, 1))
    def close_connection(self, conn):
        owner = self.conns[conn]
        ended = [i for i, lease in [*self.writes.items(), *self.reads.items()] if lease.owner is owner]
        assert self.node.end_owner(owner) == len(ended)
        for lease_id in ended:
            self.writes.pop(lease_id, None)
            self.reads.pop(lease_id, None)
        for lease_id in [i for i, (held, _) in self.fenced.items() if held is owner]:
            del self.fenced[lease_id]

    @rule()
    def expire_leases(self):
        self.clock.advance(3600)
        assert self.node.reap_expired() == len(self.writes) + len(self.reads)
        for lease in self.writes.values():
            if lease.owner.arena is not None and lease.slots:
                self.fenced[lease.lease_id] = (lease.owner, list(lease.slots.values()))
        self.writes.clear()
        self.reads.clear()

    # -- delete and tier moves -------------------------------------------------------------

    @rule(ns=st.integers(0, len(NAMESPACES) - 1), path=paths, whole=picks)
    def delete(self, ns, path, whole):
        ns_id = self.ns[ns][0]
        path = self.aim(ns_id, path, whole)
        if whole % 16 == 15:
            self.node.delete(pb.DeleteRequest(namespace_id=ns_id, all_pages=True), None)
            gone = {page for page in self.may_hold if page[0] == ns_id}
        else:
            root = key_of(path)
            self.node.delete(pb.DeleteRequest(namespace_id=ns_id, keys=[root]), None)
            gone = {page for page in self.may_hold if page[0] == ns_id and page[1].startswith(root)}
        for page in gone:
            assert self.store.index.get(page) is None, "a deleted page (or one extending it) is still held"
        self.may_hold -= gone
        self.durable -= gone

    @rule(count=st.integers(1, 40), clean_only=st.booleans())
    def evict(self, count, clean_only):
        """DRAM pressure from outside: least recently used DRAM copies go (DRAM-only pages too,
        except under write_back, which keeps them until they are written down)."""
        store = self.store
        with store._lock:
            for _ in range(count):
                if store.index.evict_dram(None, clean_only or store.protect_unsaved) is None:
                    break

    @rule(ns=st.integers(0, len(NAMESPACES) - 1), path=paths, pick=picks)
    def promote(self, ns, path, pick):
        ns_id = self.ns[ns][0]
        path = self.aim(ns_id, path, pick)
        records = self.store.index.leading(ns_id, [key_of(path[:d]) for d in range(1, len(path) + 1)])
        self.node.controller.promote([r for r in records if r.offset == NO_SLOT], deadline=float("inf"))

    @rule(ns=st.integers(0, len(NAMESPACES) - 1), path=paths, pick=picks)
    def write_down(self, ns, path, pick):
        ns_id = self.ns[ns][0]
        path = self.aim(ns_id, path, pick)
        records = self.store.index.leading(ns_id, [key_of(path[:d]) for d in range(1, len(path) + 1)])
        durable = self.node.controller.make_durable(records, deadline=float("inf"))
        self.note_durable(ns_id, [r.page_id[1] for r in records[:durable]])

    @rule(pages=st.integers(1, 16))
    def clean(self, pages):
        self.node.controller.clean(pages)

    @rule()
    def controller_pass(self):
        """One pass of the controller's background loop, in this thread: its queued writes and prefetches."""
        controller = self.node.controller
        with controller._queue:
            queued = controller._take_queued()
        controller._pass(*queued)

    @rule()
    def crash_restart(self):
        """The process dies between two calls: leases, DRAM and unsaved pages go; a new node reopens the
        same LMDB files and finds exactly the pages that were on NVMe."""
        self.restart(exact=True)

    @rule(point=st.sampled_from(["writedown.before_lmdb_commit", "writedown.after_lmdb_commit", "delete.before_nvme",
                                 "commit.before_publish", "commit.after_publish", "promote.before_read",
                                 "promote.after_read"]),
          ns=st.integers(0, len(NAMESPACES) - 1), path=paths, pick=picks)
    def crash_at(self, point, ns, path, pick):
        """The process dies at a named step of a write-down, delete, commit or promotion (the step raises,
        and nothing runs after it but the restart)."""
        failpoints.arm(f"{point}=error@1")
        try:
            if point.startswith("writedown"):
                self.write_down(ns, path, pick)
            elif point.startswith("delete"):
                self.delete(ns, path, pick)
            elif point.startswith("promote"):
                self.promote(ns, path, pick)
            elif self.writes:
                lease = list(self.writes.values())[pick % len(self.writes)]
                self.may_hold |= {(lease.ns, lease.keys[i]) for i in lease.slots}   # unanswered: maybe published
                self.commit_pages(lease, [], True, False)
        except failpoints.FailpointError:
            pass
        finally:
            failpoints.arm("")
        self.restart(exact=False)

    def restart(self, exact: bool) -> None:
        """A new node on the old one's LMDB files (closed only to drop their flock, which this process
        would otherwise still hold: LMDB synced each write-down's transaction, so closing adds nothing to
        the disk). Pages on NVMe come back, deleted ones do not; `exact`: the index knew the disk (the
        process did not die inside a write-down or delete)."""
        before = {r.page_id for r in self.store.index.records() if r.on_nvme}
        self.node.nvme.close()
        self.node.store.arena.close()
        self.node = None
        self.start_node()
        rebuilt = recovery.rebuild(self.node.nvme)
        self.store.adopt_recovered(rebuilt.namespaces, rebuilt.records)
        after = {r.page_id for r in self.store.index.records()}
        assert rebuilt.report.unreadable == 0
        if exact:
            assert rebuilt.report.orphans == 0
            assert after == before, "the pages a restart finds are not those that were on NVMe"
        lost = {page for page in self.durable if self.tenant_of(page[0]) != "alice"} - after
        assert not lost, f"pages written down were lost in a restart: {sorted(lost)[:4]}"
        assert after <= self.may_hold, "a restart brought back a page that was deleted or never committed"
        self.may_hold = set(after)
        self.durable = set(after)
        self.writes.clear()
        self.reads.clear()
        self.fenced.clear()

    @rule()
    def end_everything(self):
        """Every lease ends: nothing stays leased, pinned, claimed or counted as moving."""
        for lease_id, lease in list(self.reads.items()):
            assert self.node.release(pb.ReleaseRequest(lease_ids=[lease_id]), None).released == 1
        for lease_id, lease in list(self.writes.items()):
            self.node.abort(pb.AbortRequest(lease_id=lease_id), lease.owner)
        for lease_id, (owner, _) in list(self.fenced.items()):
            assert self.node.abort(pb.AbortRequest(lease_id=lease_id), owner).aborted_pages == 0
        self.reads.clear()
        self.writes.clear()
        self.fenced.clear()
        store = self.store
        with store._lock:
            assert len(store.leases) == 0 and not list(store.leases.all())
            assert not store._fenced and not store._promoting and not store._nvme_deleting
            assert not any(store._pending.values()), "a key is still claimed with no lease open"
            assert not store._nvme_admitted and not any(store.ledger.nvme_writing_bytes.values())
            for record in store.index.records():
                assert record.pins == 0 and not record.busy, f"{record.page_id} is still pinned or moving"
            in_dram = sum(r.slot_bytes for r in store.index.records() if r.offset != NO_SLOT)
            assert store.allocator.used_bytes == in_dram, "a slot is held by no page and no lease"
            assert sum(store.ledger.dram_bytes.values()) == in_dram

    # -- after every step ----------------------------------------------------------------

    @invariant()
    def pages_hold_their_bytes_and_no_slot_has_two_owners(self):
        store = self.store
        store.check_invariants()
        view = store.arena.view
        owners: list[tuple[int, int, str]] = []
        for record in store.index.records():
            ns_id, key = record.page_id
            assert (ns_id, key) in self.may_hold, f"a page never committed, or deleted, is held: {key!r}"
            parent = parent_of(key)
            assert (record.parent.page_id[1] if record.parent is not None else b"") == parent
            assert not parent or self.held(ns_id, parent), "a page is held without its parent"
            if record.offset != NO_SLOT:
                page_bytes = self.page_bytes_of(ns_id)
                assert bytes(view[record.offset:record.offset + page_bytes]) == content(ns_id, key, page_bytes), \
                    f"page {key!r} holds another page's bytes"
                owners.append((record.offset, record.slot_bytes, f"page {key!r}"))
        for lease in self.writes.values():
            page_bytes = self.page_bytes_of(lease.ns)
            for i, offset in lease.slots.items():
                assert bytes(view[offset:offset + page_bytes]) == content(lease.ns, lease.keys[i], page_bytes), \
                    "a reserved slot was written by someone else"
                owners.append((offset, store.allocator.slot_bytes_of(offset), f"write lease {lease.lease_id:#x}"))
        leased: set[tuple[int, int, bytes]] = set()
        for lease in self.reads.values():
            page_bytes = self.page_bytes_of(lease.ns)
            for key, offset in zip(lease.keys, lease.offsets):
                assert bytes(view[offset:offset + page_bytes]) == content(lease.ns, key, page_bytes), \
                    f"a leased page changed under its reader: {key!r}"
                record = store.index.get((lease.ns, key))
                gone = record is None or record.offset != offset   # deleted or evicted since: the lease keeps the slot
                if gone and (offset, lease.ns, key) not in leased:   # two leases on one page share its slot
                    leased.add((offset, lease.ns, key))
                    owners.append((offset, store.allocator.slot_bytes_of(offset), f"read lease {lease.lease_id:#x}"))
        for lease_id, (_, offsets) in self.fenced.items():
            owners += [(offset, store.allocator.slot_bytes_of(offset), f"fence {lease_id:#x}") for offset in offsets]
        owners.sort()
        for (offset, nbytes, who), (next_offset, _, next_who) in zip(owners, owners[1:]):
            assert offset + nbytes <= next_offset, f"{who} and {next_who} share DRAM at {next_offset}"
        durable_held = {page for page in self.durable if self.tenant_of(page[0]) != "alice"}
        missing = [page for page in durable_held if not self.held(*page)]
        assert not missing, f"pages on NVMe left the store without a delete: {missing[:4]}"
        assert len(store.leases) == len(self.writes) + len(self.reads)
        assert store.fenced_slots() == sum(len(offsets) for _, offsets in self.fenced.values())


@pytest.mark.parametrize("native", [
    pytest.param("true", id="native-index",
                 marks=pytest.mark.skipif(not native_index.available(), reason="kvstore_native is not built")),
    pytest.param("false", id="python-index")])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_random_runs_keep_the_store_right(policy, native):
    machine = type("Machine", (StoreMachine,), {"policy": policy, "native": native})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, derandomize=True, database=None, deadline=None,
        suppress_health_check=list(HealthCheck), print_blob=False))
