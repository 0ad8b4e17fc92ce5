"""Page groups in the SDK: the pages several namespaces keep for the same keys, stored and read as one.

A hybrid model keeps beside each KV page the sidecar pages of the same position (Mamba state,
sliding-window KV, indexer, draft pages), each in a namespace of its own. The node makes such a
group visible in one step (CommitGroup), answers which prefixes can be restored whole from one
snapshot (LookupGroup, with each part's hit policy) and pins every part of a read at once
(AcquireGroup). Here is what both clients share: the parts of a lookup, the answer, pages staged
for a group commit (written into their slots, not yet visible), and the folds over answers.

Which prefixes a group can restore (fold: the node's answer to LookupGroup, and a cluster's over
what each node holds):
- the first part (the KV pool) bounds the answer with its leading pages, as a Lookup does;
- a GROUP_ALL_PAGES part accepts a prefix when every page of it is present;
- a GROUP_TRAILING_PAGES part accepts a prefix when its last `trailing_pages` pages are present
  (a state that summarises everything before it needs only the pages at the cut).
A prefix is restorable when every part accepts it. Once no prefix is left, later parts are not
weighed (each answers 0), as SGLang's own backends answer.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from kvstore_client import checksums, errors
from kvstore_client.buffers import Segment
from kvstore_client.keys import Key, Namespace, encode_keys
from kvstore_client.node_steps import Post, PutPages, Steps, call
from kvstore_client.pipeline import (LEASE_MARGIN_S, STORED_STATES, PutResult, changed_pages, check_loaded,
                                     commit_checksums, reserved_pages)
from kvstore_client.proto import pb

HIT_POLICIES = {"all_pages": pb.GROUP_ALL_PAGES, "trailing_pages": pb.GROUP_TRAILING_PAGES}


@dataclasses.dataclass(frozen=True)
class GroupPart:
    """One namespace of a group lookup and what it needs of a prefix: "all_pages" (every page) or
    "trailing_pages" (its last `trailing_pages` pages). The first part bounds the answer with its leading
    pages and must be "all_pages" (the KV pool)."""

    namespace: Namespace
    hit_policy: str = "all_pages"
    trailing_pages: int = 0


@dataclasses.dataclass(frozen=True)
class GroupHits:
    hit_pages: int               # the longest prefix every part accepts
    part_hit_pages: list[int]    # each part's own longest accepted prefix (0 once no prefix was left)
    restorable_pages: list[int]  # every prefix length all parts accept, ascending


@dataclasses.dataclass(eq=False)
class StagedPages:
    """Pages of one namespace written into their slots under a write lease and not yet visible: a part
    of a group commit (KVStoreClient.stage, then commit_group). The lease expires after its TTL like any
    write lease; pages never committed are then aborted by the node and never become visible."""

    namespace: Namespace
    keys: list[bytes]
    states: list[int]                 # the Reserve state of each key (RESERVED: staged here)
    lease_id: int                     # 0 when no page needed writing (every key stored already)
    slots: dict[bytes, tuple[int, int | None]]   # staged key -> (index in the lease, checksum or None)
    from_writer: bool                 # the checksums are the writer's, taken as it copied the bytes
    commit_by: float                  # time.monotonic() after which the lease may have expired

    @property
    def stored(self) -> int:
        """Leading keys that are stored once this part commits (staged, or stored already)."""
        return next((i for i, state in enumerate(self.states) if state not in STORED_STATES), len(self.states))

    def take(self, keys: Sequence[Key]) -> "StagedPages":
        """The staged pages of these keys, as a part of their own; they leave this one (which keeps the rest
        of its lease's pages for a later group)."""
        wanted = set(encode_keys(keys))
        taken = {key: slot for key, slot in self.slots.items() if key in wanted}
        for key in taken:
            del self.slots[key]
        positions = [i for i, key in enumerate(self.keys) if key in wanted]
        return StagedPages(self.namespace, [self.keys[i] for i in positions], [self.states[i] for i in positions],
                           self.lease_id if taken else 0, taken, self.from_writer, self.commit_by)

    def commit_request(self) -> pb.CommitRequest:
        indices = [index for index, _ in self.slots.values()]
        sums = [checksum for _, checksum in self.slots.values()]
        return pb.CommitRequest(lease_id=self.lease_id, indices=indices,
                                checksums=sums if None not in sums else [], checksums_from_writer=self.from_writer)


def stage_batch(conn: Any, ns_id: int, namespace: Namespace, keys: list[bytes], segments: list[list[Segment]],
                parent: bytes, anchored: bool, verify: bool, parent_keys: Sequence[bytes] = ()) -> Steps[StagedPages]:
    """Reserve the keys and copy every page given a slot into it; commit nothing (steps of an attempt:
    node_steps.py). `parent_keys`: each key's parent (put's parents=), or none."""
    sent_at = time.monotonic()
    reserved = yield from call("Reserve", pb.ReserveRequest(
        namespace_id=ns_id, parent_key=parent_keys[0] if parent_keys else parent, keys=keys,
        page_bytes=namespace.page_bytes, rdma_qp_num=conn.data.rdma_qp_num, anchor_absent_parent=anchored,
        parent_keys=parent_keys))
    try:
        positions = [i for i, state in enumerate(reserved.states) if state == pb.RESERVED]
        pages = reserved_pages(reserved, positions, segments)
        written = (yield PutPages(reserved.lease_id, reserved.data_token, pages, namespace.page_bytes)) \
            if positions else None
        return staged_pages(namespace, keys, reserved, positions, written, segments, verify, sent_at)
    except BaseException:
        if reserved.lease_id:
            yield Post("Abort", pb.AbortRequest(lease_id=reserved.lease_id))
        raise


def staged_pages(namespace: Namespace, keys: list[bytes], reserved: pb.ReserveResponse, positions: list[int],
                 written: list[int] | None, segments: list[list[Segment]], verify: bool,
                 sent_at: float) -> StagedPages:
    """What a Reserve and the copy into its slots staged (both clients)."""
    if not positions:
        sums, from_writer = [], False
    else:
        sums, from_writer = commit_checksums(written, [segments[i] for i in positions] if written is None else [],
                                             verify)
    slots = {keys[i]: (reserved.first_index + i, sums[n] if sums else None) for n, i in enumerate(positions)}
    return StagedPages(namespace, keys, list(reserved.states), reserved.lease_id if positions else 0, slots,
                       from_writer, sent_at + reserved.lease_ttl_ms / 1000 - LEASE_MARGIN_S)


def commit_group_request(parts: Sequence[StagedPages]) -> pb.CommitGroupRequest | None:
    """The CommitGroup of these parts (those with pages to publish); None when none has any."""
    if not all(isinstance(part, StagedPages) for part in parts):
        raise errors.InvalidArgument("commit_group takes the StagedPages that stage() returned")
    if len({id(part) for part in parts}) != len(parts):
        raise errors.InvalidArgument("a StagedPages appears twice in the group")
    live = [part for part in parts if part.lease_id and part.slots]
    if len({part.lease_id for part in live}) != len(live):
        raise errors.InvalidArgument("two parts of the group share a write lease: take() the keys of one lease "
                                     "into one part")
    if any(time.monotonic() > part.commit_by for part in live):
        raise errors.LeaseNotFound("a staged part's write lease may have expired before its group commit: stage "
                                   "it again (raise leases.write_ttl_ms if the group's writes take longer)")
    return pb.CommitGroupRequest(parts=[part.commit_request() for part in live]) if live else None


def committed(parts: Sequence[StagedPages]) -> list[PutResult]:
    """Each part's count once its group committed (every staged page of it is then visible)."""
    for part in parts:
        part.slots.clear()
    return [PutResult(part.stored, len(part.keys), "" if part.stored == len(part.keys) else
                      f"page {part.stored} was refused (reserve state {pb.ReserveState.Name(part.states[part.stored])})")
            for part in parts]


def lookup_group_request(keys: Sequence[Key], parts: Sequence[GroupPart], limits: pb.Limits) -> pb.LookupGroupRequest:
    """A LookupGroup's request, its namespace ids left to fill in; checked before anything is sent."""
    raw_keys = encode_keys(keys)
    most = limits.lookup_pages_max or limits.batch_pages_max
    if len(raw_keys) > most:
        raise errors.InvalidArgument(f"{len(raw_keys)} keys: a group lookup is one snapshot of at most "
                                     f"{most} keys (limits.lookup_pages_max); ask for the prefix that matters")
    if not parts or not all(isinstance(part, GroupPart) for part in parts):
        raise errors.InvalidArgument("parts must be a non-empty list of GroupPart(namespace, hit_policy, "
                                     "trailing_pages), the KV part first")
    for part in parts:
        if part.hit_policy not in HIT_POLICIES:
            raise errors.InvalidArgument(f"hit_policy must be one of {sorted(HIT_POLICIES)}, got {part.hit_policy!r}")
        if not isinstance(part.trailing_pages, int) or part.trailing_pages < 0:
            raise errors.InvalidArgument(f"trailing_pages must be a count of pages, got {part.trailing_pages!r}")
    return pb.LookupGroupRequest(keys=raw_keys, parts=[
        pb.GroupPart(hit_policy=HIT_POLICIES[part.hit_policy], trailing_pages=part.trailing_pages) for part in parts])


def fold(leading: int, present: Sequence[Sequence[bool]], parts: Sequence[pb.GroupPart]) -> GroupHits:
    """The group's answer from one snapshot: `leading` pages of the first part, and for every other
    part whether its page of each of those positions is present (present[i] for parts[i + 1])."""
    restorable = list(range(1, leading + 1))
    part_hits = [leading]
    for part, found in zip(parts[1:], present):
        if not restorable:
            part_hits.append(0)
            continue
        accepted = _accepted(part, found, leading)
        part_hits.append(max(accepted, default=0))
        restorable = [length for length in restorable if length in accepted]
    return GroupHits(restorable[-1] if restorable else 0, part_hits, restorable)


def _accepted(part: pb.GroupPart, found: Sequence[bool], leading: int) -> set[int]:
    """The prefix lengths (1..leading) one part accepts under its policy."""
    if part.hit_policy == pb.GROUP_ALL_PAGES:
        boundary = next((i for i in range(leading) if not found[i]), leading)
        return set(range(1, boundary + 1))
    trailing = max(1, part.trailing_pages)
    accepted, run = set(), 0
    for length in range(1, leading + 1):
        run = run + 1 if found[length - 1] else 0   # present pages ending at this prefix's last one
        if run >= min(trailing, length):
            accepted.add(length)
    return accepted


def group_hits(answer: pb.LookupGroupResponse) -> GroupHits:
    return GroupHits(answer.hit_pages, list(answer.part_hit_pages), list(answer.restorable_pages))


def whole_positions(part_keys: Sequence[Sequence[bytes]], hits: Sequence[int]) -> list[int]:
    """Each part's leading pages to load so that a key loads in every part that names it, or in none:
    a part stops at the first key another part did not hit (repeated until no part changes)."""
    hits = list(hits)
    while True:
        missing = {key for keys, hit in zip(part_keys, hits) for key in keys[hit:]}
        cut = [next((i for i, key in enumerate(keys[:hit]) if key in missing), hit)
               for keys, hit in zip(part_keys, hits)]
        if cut == hits:
            return hits
        hits = cut


def part_loads(acquired: pb.AcquireGroupResponse, counts: Sequence[int],
               segments: Sequence[list[list[Segment]]]) -> list[tuple[int, bytes, list, int]]:
    """(lease id, data token, pages, page bytes) of each part with pages to load: a data path's get arguments."""
    return [(answer.lease_id, answer.data_token, [(i, answer.offsets[i], part[i]) for i in range(count)],
             answer.page_bytes)
            for answer, count, part in zip(acquired.parts, counts, segments) if count]


def release(acquired: pb.AcquireGroupResponse, landed: dict[int, list[int] | None]) -> Steps[dict[int, list[int]]]:
    """Release a group read's leases; a lease with pages that changed in shared memory (`landed`: each lease's
    hashes of what its copy landed, where the data path took them) names them in a Release of its own.
    Returns the changed page indices by lease."""
    changed = {answer.lease_id: changed_pages(answer, landed.get(answer.lease_id))
               for answer in acquired.parts if answer.lease_id}
    plain = [lease_id for lease_id, pages in changed.items() if not pages]
    if plain:
        yield Post("Release", pb.ReleaseRequest(lease_ids=plain))
    for lease_id, pages in changed.items():
        if pages:
            yield Post("Release", pb.ReleaseRequest(lease_ids=[lease_id], changed_pages=pages))
    return changed


def check_group_loaded(acquired: pb.AcquireGroupResponse, counts: Sequence[int],
                       segments: Sequence[list[list[Segment]]], sent_at: float, verify: bool,
                       changed: dict[int, list[int]]) -> None:
    """Fail a group read whose pages may be torn (a lease expired under it), changed in shared memory, or,
    with verify, do not match."""
    for answer, count, part_segments in zip(acquired.parts, counts, segments):
        if not count:
            continue
        check_loaded(answer, sent_at, part_segments, False, changed.get(answer.lease_id, []))
        for i in range(count if verify else 0):
            if checksums.of_page(part_segments[i]) != answer.checksums[i]:
                raise errors.ChecksumMismatch(f"page {i} of lease {answer.lease_id:#x} does not match its checksum")
