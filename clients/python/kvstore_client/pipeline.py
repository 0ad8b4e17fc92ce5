"""Put and get over any data path: the one place leases, groups, runs and counts are handled.

A put reserves its chain in groups and moves and commits each group in runs (the sizes are the data
path's PipelineShape: the first group may be short and a long last group is committed in halves, as
the first Reserve and the last Commit overlap no copy). The next group's Reserve is in flight while
this group moves, and the server checksums one run while the next one moves (unless the pages were
checksummed as they were copied: by the data path, then the Commit carries those, or by the node as
each TCP page landed; either way the server reads nothing back). A move the node copies with this process
(a shared page buffer's) has its Commit sent before the move's answer is read (assisted_copy.MoveInFlight),
and the put reads every such answer before it returns. Pages become visible in chain
order, because a page whose parent is not yet visible is dropped at commit:

- on a control channel that answers in order (the local channel), everything is submitted
  without waiting: the next group extends this group's write lease (its Reserve is answered
  before any of this group's Commits, so the lease still holds uncommitted slots), and Commits
  are answered in the order they were sent;
- without order (gRPC), each group opens its own lease (a Commit could end a lease before an
  extending Reserve arrives), and each Commit is sent once the one before it has answered.

A failure aborts every lease the put opened, that of a Reserve sent ahead and not yet answered too. A get acquires the leading pages under a read
lease, moves them, and releases the lease without waiting for the answer. Either way, a page
moved after its lease could have expired fails the call (LeaseNotFound), never returns torn.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from kvstore_client import checksums, errors, packed
from kvstore_client.assisted_copy import MoveInFlight
from kvstore_client.buffers import PageSegments, Segment
from kvstore_client.data_path import PageColumns
from kvstore_client.node_steps import CONTROL, GRPC, Answer, GetPages, Post, PutPages, Send, Settle, Steps
from kvstore_client.proto import pb

# A transfer into or out of a leased slot must end this long before the lease can expire.
LEASE_MARGIN_S = 0.5
# Reserve states after which a page is (or will be, by another writer) stored: the chain goes on.
STORED_STATES = (pb.RESERVED, pb.PRESENT, pb.IN_FLIGHT)


class PutBatch:
    """One batch of a put: keys continuing the chain after `parent`, with their pages' segments."""

    def __init__(self, page_bytes: int, parent: bytes, keys: list[bytes], segments: PageSegments,
                 verify: bool, durable: bool, anchor: bytes = b"", parents: list[bytes] | None = None):
        """`anchor`: instead of `parent`, the key of a page before keys[0] the node may no longer hold.
        `parents`: instead of either, each key's parent (ReserveRequest.parent_keys)."""
        self.page_bytes, self.parent, self.keys, self.segments = page_bytes, anchor or parent, keys, segments
        self.verify, self.durable, self.anchored = verify, durable, bool(anchor)
        self.parents = parents
        if parents is not None:
            self.parent = parents[0]
        # Set once a Reserve gave this batch a slot: from then on a failed attempt is not repeated
        # elsewhere (its pages may have been copied into a node that is gone).
        self.slots_reserved = False

    def steps(self, conn: Any, ns_id: int) -> Steps[PutResult]:
        """Store the batch (an attempt: node_steps.py); returns how many leading keys are now stored (see stored_pages)."""
        keys, in_order, shape = self.keys, conn.control.answers_in_order, conn.data.shape
        packs = conn.hello.limits.pages_packed   # the node reads and answers packed fields (packed.py)
        ahead = conn.hello.limits.commit_copied_by_node and not self.verify   # a Commit before its move's answer
        groups = shape.reserve_groups(len(keys), self.page_bytes)
        run = shape.run_pages(self.page_bytes)
        states: list[int] = []
        commits: list[Any] = []
        move_until: dict[int, float] = {}    # write lease -> when moving pages under it must have ended
        moving: list[MoveInFlight] = []      # moves whose Commit went out before their answer was read
        sent_at, next_reserve = time.monotonic(), (yield self._reserve(conn, ns_id, *groups[0], 0, packs))
        unread = next_reserve   # a Reserve sent whose answer (and the lease it may open) is not read yet
        try:
            for number, (start, _) in enumerate(groups):
                reserved = yield Answer(next_reserve)
                unread = None
                group_states = packed.reserve_states(reserved)
                states += group_states
                indices = _reserved_indices(group_states)
                self.slots_reserved |= bool(indices)
                if reserved.lease_id and reserved.lease_id not in move_until:
                    move_until[reserved.lease_id] = sent_at + reserved.lease_ttl_ms / 1000 - LEASE_MARGIN_S
                chain_goes_on = len(indices) == len(group_states) or all(s in STORED_STATES for s in group_states)
                last = number == len(groups) - 1
                if not last and chain_goes_on:
                    extend = reserved.lease_id if in_order and indices else 0
                    next_start, next_stop = groups[number + 1]
                    sent_at, next_reserve = time.monotonic(), (yield self._reserve(
                        conn, ns_id, next_start, next_stop, extend, packs))
                    unread = next_reserve
                for first, stop in commit_runs(run, len(indices), self.page_bytes, last):
                    after = commits[-1] if commits and not in_order else None
                    commits.append((yield from self._move_and_commit(reserved, start, indices[first:stop],
                                                                     move_until[reserved.lease_id], after, packs,
                                                                     moving if ahead else None)))
                if not chain_goes_on:
                    break
            while moving:
                yield Settle(moving.pop(0))
            answers = []
            for commit in commits:
                answers.append((yield Answer(commit)))
        except BaseException:
            for move in moving:   # the node's part read before the call ends: it may still be reading the buffer
                try:
                    yield Settle(move)
                except Exception:   # the put fails with what failed first
                    pass
            leases = set(move_until)
            if unread is not None:   # sent ahead: its lease, if it opened one, is aborted too
                try:
                    leases.add((yield Answer(unread)).lease_id)
                except Exception:   # it failed as well, and holds nothing
                    pass
            for lease_id in leases - {0}:
                yield Post("Abort", pb.AbortRequest(lease_id=lease_id))
            raise
        return stored_pages(states, answers, self.durable)

    def _reserve(self, conn: Any, ns_id: int, start: int, stop: int, lease_id: int, packs: bool) -> Send:
        """The Reserve of keys[start:stop] (lease_id 0 opens a lease, else extends it); `packs`: its answer packed."""
        if self.parents is not None:
            parent, parent_keys = self.parents[start], self.parents[start:stop]
        else:
            parent, parent_keys = self.keys[start - 1] if start else self.parent, []
        request = pb.ReserveRequest(namespace_id=ns_id, parent_key=parent, keys=self.keys[start:stop],
                                    page_bytes=self.page_bytes, lease_id=lease_id, rdma_qp_num=conn.data.rdma_qp_num,
                                    anchor_absent_parent=self.anchored and not start, parent_keys=parent_keys,
                                    packed_answer=packs)
        return Send("Reserve", request)

    def _move_and_commit(self, reserved: pb.ReserveResponse, start: int, indices: Sequence[int], move_until: float,
                         after: Any, packs: bool, moving: list[MoveInFlight] | None) -> Steps[Any]:
        """Move a run of reserved pages (keys[start + i] for i in indices) into their slots, then send its
        Commit, once `after` (the Commit before it, on a channel without order) has answered; `packs`: the
        Commit in its packed form. With `moving` (not None), a move the node copies with this process is sent
        its Commit at once, the node's pages flagged (copied_by_node), and joins `moving`, to be settled before
        the put returns (a put with verify sends the node's checksums, and reads them first)."""
        if time.monotonic() > move_until:
            raise errors.LeaseNotFound("the write lease would expire before the pages moved; "
                                       "raise leases.write_ttl_ms or put fewer pages per call")
        pages = reserved_pages(reserved, indices, self.segments, start)
        written = yield PutPages(reserved.lease_id, reserved.data_token, pages, self.page_bytes,
                                 ahead=moving is not None)
        copied_by_node = b""
        if isinstance(written, MoveInFlight):
            moving.append(written)
            written, copied_by_node = written.checksums, written.copied_by_node
        sums, from_writer = commit_checksums(written, pages.segments if written is None else [], self.verify)
        if after is not None:
            yield Answer(after)
        request = commit_request(reserved.lease_id, pages.indices, sums, self.durable, from_writer, packs)
        request.copied_by_node = copied_by_node
        return (yield Send("Commit", request))


# The last Commit of a put is the one whose checking overlaps no copy, and over shared memory the node has
# mostly gone to sleep by then (shm.spin_us) and takes 60-90 us to wake. So a put's last group ends
# with a short Commit, of the pages in its last TAIL_COMMIT_BYTES (at least one page): the Commit before
# it is answered while they are copied (see channel.OrderedChannel._spin_until_readable for what the two
# gave 64 KiB pages). For 4 KiB pages it halves a group of 512, as before (3-4% more puts/s).
TAIL_COMMIT_BYTES = 1 << 20


def commit_runs(run: int, pages: int, page_bytes: int, last: bool) -> list[tuple[int, int]]:
    """(first, stop) of each Commit of a group of `pages`: runs of `run` pages, and in a put's `last` group
    the tail apart, where the group holds at least two tails."""
    tail = max(1, TAIL_COMMIT_BYTES // page_bytes)
    body = pages - tail if last and pages >= 2 * tail else pages
    runs = [(first, min(first + run, body)) for first in range(0, body, run)]
    return runs + [(body, pages)] if body < pages else runs


def commit_request(lease_id: int, indices: Sequence[int], sums: list[int], durable: bool, from_writer: bool,
                   packs: bool) -> pb.CommitRequest:
    """A Commit of these lease indices; `packs`: a run of them and the checksums packed, the answer packed too."""
    if not packs:
        return pb.CommitRequest(lease_id=lease_id, indices=indices, checksums=sums, durable=durable,
                                checksums_from_writer=from_writer)
    request = pb.CommitRequest(lease_id=lease_id, checksums_packed=packed.u64s(sums), durable=durable,
                               checksums_from_writer=from_writer, packed_answer=True)
    if isinstance(indices, range) and indices.step == 1 and indices:
        request.first_index, request.index_count = indices.start, len(indices)
    else:
        request.indices.extend(indices)
    return request


def reserved_pages(reserved: pb.ReserveResponse, indices: Sequence[int], segments: PageSegments,
                   start: int = 0) -> PageColumns:
    """The pages a Reserve gave slots to, keys[start + i] for i in `indices` (ascending), with their lease
    indices, slots and segments[start + i]; a run without gaps is sliced, not gathered page by page."""
    first, offsets = reserved.first_index, packed.offsets(reserved)
    low, high = (indices[0], indices[-1] + 1) if indices else (0, 0)
    if high - low == len(indices):
        return PageColumns(range(first + low, first + high), offsets[low:high],
                           segments[start + low:start + high])
    return PageColumns([first + i for i in indices], [offsets[i] for i in indices],
                       [segments[start + i] for i in indices])


def _reserved_indices(states: list[int]) -> Sequence[int]:
    """Positions of the pages a Reserve gave this put a slot for (most often all of them: a range)."""
    if states.count(pb.RESERVED) == len(states):
        return range(len(states))
    return [i for i, state in enumerate(states) if state == pb.RESERVED]


def commit_checksums(written: list[int] | None, segments: list[list[Segment]], verify: bool) -> tuple[list[int], bool]:
    """A Commit's checksums, and whether they are the writer's word for the slots (from the copy itself).

    verify: the node hashes the slots and compares (end to end); else a checksum taken while
    copying is the writer's word for the slot, and the node records it without reading back.
    """
    if verify:
        return (written if written is not None else [checksums.of_page(page) for page in segments]), False
    return written or [], written is not None


class PutResult(int):
    """How many leading keys a put stored (it is that int), how many it was asked for, and why it stopped short.

    `reason` is "" when every key was stored; else it names the first key not stored and why:
    "NO_SPACE: ..." when the node is full, "PARENT_MISSING: ..." when the chain's parent is not
    cached, "PARENT_GONE: ...", "NOT_DURABLE: ...". Code that reads the count as an int keeps working.
    """

    asked: int
    reason: str

    def __new__(cls, stored: int, asked: int, reason: str = "") -> "PutResult":
        result = super().__new__(cls, stored)
        result.asked, result.reason = asked, reason
        return result

    @property
    def stored(self) -> int:
        return int(self)

    @property
    def complete(self) -> bool:
        return int(self) == self.asked

    def __repr__(self) -> str:
        return f"PutResult(stored={int(self)}, asked={self.asked}, reason={self.reason!r})"

    def __str__(self) -> str:    # printed and formatted as the count it is
        return str(int(self))


def stored_pages(states: Sequence[int], answers: Sequence[pb.CommitResponse], durable: bool) -> PutResult:
    """Leading keys stored, from each key's Reserve state and the Commit answers, in the order sent.

    A key counts when its page was already present or being written by another client (its
    state says so), or when this put reserved it and its Commit answered COMMITTED; with
    `durable`, a page this put wrote counts only if it is among the leading `durable_pages` of
    its Commit's answer (on NVMe). Counting stops at the first key that does not count, and
    the result says why.
    """
    if not durable and _all_stored(states, answers):
        return PutResult(len(states), len(states))
    written = iter([(state, j < answer.durable_pages)
                    for answer in answers for j, state in enumerate(packed.commit_states(answer))])
    for stored, state in enumerate(states):
        if state in (pb.PRESENT, pb.IN_FLIGHT):
            continue
        if state == pb.RESERVED:
            commit_state, on_nvme = next(written, (None, False))
            if commit_state == pb.COMMITTED and (not durable or on_nvme):
                continue
            return PutResult(stored, len(states), _why_not_written(stored, commit_state))
        return PutResult(stored, len(states), _why_not_reserved(stored, state))
    return PutResult(len(states), len(states))


def _all_stored(states: Sequence[int], answers: Sequence[pb.CommitResponse]) -> bool:
    """Whether every key was stored (the common case, counted without a loop in Python)."""
    states = states if isinstance(states, list) else list(states)
    reserved = states.count(pb.RESERVED)
    if reserved != len(states) and reserved + states.count(pb.PRESENT) + states.count(pb.IN_FLIGHT) != len(states):
        return False
    written = [packed.commit_states(answer) for answer in answers]
    return sum(map(len, written)) == reserved and sum(list(w).count(pb.COMMITTED) for w in written) == reserved


def _why_not_reserved(index: int, state: int) -> str:
    if state == pb.NO_SPACE:
        return (f"NO_SPACE: the node is full: no slot could be freed for page {index} (every evictable page is "
                "pinned by a lease or still being written); retry later or give the node more dram.arena_bytes")
    if state == pb.PARENT_MISSING:
        return (f"PARENT_MISSING: the parent of page {index} is not cached (evicted, or never put): "
                "put the chain from its first page")
    return f"page {index} was refused (reserve state {pb.ReserveState.Name(state)})"


def _why_not_written(index: int, commit_state: int | None) -> str:
    if commit_state == pb.COMMIT_PARENT_MISSING:
        return f"PARENT_GONE: the parent of page {index} vanished before it was committed (its writer aborted)"
    if commit_state == pb.COMMITTED:
        return f"NOT_DURABLE: page {index} is committed in DRAM but the node did not report it on NVMe"
    return f"page {index} was reserved but never committed"


def get_batch(request: pb.AcquireRequest, keys: list[bytes], segments: PageSegments, verify: bool,
              on_hot: Callable[[list[tuple[bytes, int]]], None] | None = None) -> Callable[[Any], Steps[int]]:
    """The attempt (node_steps.py) that acquires the leading pages of `keys` (the request names the rest:
    namespace, prefetch policy, waits), moves them and releases them; it returns how many were loaded.
    `on_hot` is told (key, checksum) of the loaded pages the node flagged hot (AcquireResponse.hot_pages).

    Where the data path's shape says so, the keys are acquired in parts, every Acquire sent at once: the
    node pins the next part while this one is copied. Loading stops at the first part not wholly hit;
    the leases of the parts after it are released unread. An Acquire that waits for commits goes over
    gRPC (acquire_channel).
    """
    def attempt(conn: Any) -> Steps[int]:
        request.rdma_qp_num = conn.data.rdma_qp_num
        request.packed_answer = conn.hello.limits.pages_packed
        transfer = getattr(conn, "transfer", None)
        # A part waiting for commits or promotion would add its wait to the parts before it: one Acquire then.
        whole = request.wait_ms or request.timeout_ms
        part = len(keys) if whole else conn.data.shape.acquire_part_pages(len(keys))
        bounds = [(start, min(start + part, len(keys))) for start in range(0, len(keys), part)]
        over = acquire_channel(request.wait_ms)
        calls = []
        for start, stop in bounds:
            calls.append((time.monotonic(), (yield Send("Acquire", _acquire_part(request, keys[start:stop]), over))))
        loaded, leases, answered = 0, [], 0
        try:
            for (start, stop), (sent_at, sent) in zip(bounds, calls):
                acquired = yield Answer(sent)
                answered += 1
                hits = acquired.hit_pages
                if not hits:
                    break
                landed = None
                try:
                    pages = PageColumns(range(hits), packed.offsets(acquired)[:hits],
                                        segments[start:start + hits])
                    moving = time.monotonic()
                    landed = yield GetPages(acquired.lease_id, acquired.data_token, pages, acquired.page_bytes)
                    if transfer is not None:   # this data plane's rate, for fetch-or-recompute (load_estimate.py)
                        transfer.moved(hits * acquired.page_bytes, time.monotonic() - moving)
                finally:
                    changed = changed_pages(acquired, landed)
                    if changed:   # named with its one lease, so the node drops those pages
                        yield Post("Release", pb.ReleaseRequest(lease_ids=[acquired.lease_id], changed_pages=changed))
                    else:
                        leases.append(acquired.lease_id)
                check_loaded(acquired, sent_at, segments[start:start + hits], verify, changed)
                if acquired.hot_pages and on_hot is not None:
                    sums = packed.checksums(acquired)
                    on_hot([(keys[start + i], sums[i]) for i in acquired.hot_pages if i < hits])
                loaded += hits
                if hits < stop - start:
                    break
        finally:
            leases += yield from _leases_of(calls[answered:])
            if leases:
                yield Post("Release", pb.ReleaseRequest(lease_ids=leases))
        return loaded
    return attempt


def acquire_channel(wait_ms: int) -> str:
    """The channel a get's Acquire goes over: one that waits for commits goes over gRPC, whose calls run side by
    side on the node, not over the local channel, whose calls the node answers one after another (the wait would
    hold up every other call of this client to the node)."""
    return GRPC if wait_ms else CONTROL


def _acquire_part(request: pb.AcquireRequest, keys: list[bytes]) -> pb.AcquireRequest:
    """The Acquire of `keys`, its other fields those of `request` (which names no keys)."""
    part = pb.AcquireRequest(keys=keys)
    part.MergeFrom(request)
    return part


def _leases_of(calls: list[tuple[float, Any]]) -> Steps[list[int]]:
    """The leases Acquires not read yet opened (they are answered in any case), to be released unread."""
    leases = []
    for _, sent in calls:
        try:
            lease_id = (yield Answer(sent)).lease_id
        except errors.KVStoreError:   # nothing was pinned for it, or the node is gone with its leases
            continue
        if lease_id:
            leases.append(lease_id)
    return leases


def changed_pages(acquired: pb.AcquireResponse, landed: list[int | None] | None) -> list[int]:
    """Indices of the pages whose copied bytes (hashed as they landed) differ from the node's checksums; a page
    landed as None was vouched for by the node (tcp_framing.VOUCHED) and not hashed."""
    if landed is None:
        return []
    want = packed.checksums(acquired)[:len(landed)]
    if isinstance(landed, memoryview):   # uint64s (copy_out_hashed_rows): compared as bytes, not page by page
        if packed.u64s(landed) == packed.u64s(want):
            return []
        landed = landed.tolist()
    want = list(want)
    if landed == want or landed.count(None) == len(landed):   # the common cases, without a loop in Python
        return []
    return [i for i, (got, sum_) in enumerate(zip(landed, want)) if got is not None and got != sum_]


def check_loaded(acquired: pb.AcquireResponse, sent_at: float, segments: list[list[Segment]], verify: bool,
                 changed: list[int]) -> None:
    """Fail a get whose pages may be torn (LeaseNotFound) or do not match their checksums (ChecksumMismatch:
    changed in shared memory, always checked there; with verify, on any data plane)."""
    # The lease started after sent_at, so ending before sent_at + ttl means no page could
    # have been evicted (and its slot reused) under the transfer.
    if time.monotonic() > sent_at + acquired.lease_ttl_ms / 1000:
        raise errors.LeaseNotFound("the read lease expired during the transfer; the pages may be torn")
    if changed:
        raise errors.ChecksumMismatch(
            f"pages {changed} of this get no longer match the checksums recorded when they were committed: a "
            "client of this tenant changed them in shared memory (or they were damaged on the way). The node drops "
            "each it finds changed; put them again")
    if verify:
        sums = packed.checksums(acquired)
        for i in range(acquired.hit_pages):
            if checksums.of_page(segments[i]) != sums[i]:
                raise errors.ChecksumMismatch(f"page {i} does not match its checksum")
