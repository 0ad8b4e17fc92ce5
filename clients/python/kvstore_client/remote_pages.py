"""Put and get over a data path that is not shared memory (TCP, RDMA), with gRPC as control.

The protocol is the shared-memory one: Reserve hands out slots under a write lease, the
data path moves the bytes, Commit makes them visible; Acquire pins pages under a read
lease, the data path moves them out, Release ends it. Only "move these bytes" differs.

A put reserves its chain in groups (the next group's Reserve is in flight while this
group moves) and commits in runs, each Commit started when the one before it has
answered, so the server checksums run k while run k+1 is on the wire and pages become
visible in chain order.
"""

from __future__ import annotations

import ctypes
import time
from typing import Protocol

from kvstore_client import errors
from kvstore_client.buffers import Segment
from kvstore_client.channel import GrpcCall, GrpcChannel
from kvstore_client.proto import pb

try:  # optional, as for shared memory: end-to-end checks of what this process sent or received
    import xxhash
except ImportError:  # pragma: no cover - exercised where xxhash is absent
    xxhash = None

RESERVE_GROUP_BYTES = 64 << 20
COMMIT_RUN_BYTES = 16 << 20
LEASE_MARGIN_S = 0.5      # a transfer into or out of a leased slot must end this long before the lease can
_STORED_STATES = (pb.RESERVED, pb.PRESENT, pb.IN_FLIGHT)


class DataPath(Protocol):
    name: str

    def put(self, lease_id: int, token: bytes, pages: list[tuple[int, int, list[Segment]]],
            page_bytes: int) -> None: ...
    def get(self, lease_id: int, token: bytes, pages: list[tuple[int, int, list[Segment]]],
            page_bytes: int) -> None: ...
    def close(self) -> None: ...


def checksum(segments: list[Segment]) -> int:
    """xxh3-64 of a page given as segments, as the server hashes the slot."""
    hasher = xxhash.xxh3_64()
    for address, nbytes in segments:
        hasher.update(memoryview((ctypes.c_char * nbytes).from_address(address)))
    return hasher.intdigest()


class RemotePages:
    def __init__(self, control: GrpcChannel, data: DataPath):
        self.control = control
        self.data = data

    def put_batch(self, ns_id: int, page_bytes: int, parent: bytes, keys: list[bytes],
                  segments: list[list[Segment]], verify: bool) -> int:
        """Store one batch (a chain continuing `parent`); returns how many leading keys are now stored."""
        group = max(1, RESERVE_GROUP_BYTES // page_bytes)
        run = max(1, COMMIT_RUN_BYTES // page_bytes)

        def reserve(start: int, parent_key: bytes) -> tuple[float, GrpcCall]:
            request = pb.ReserveRequest(namespace_id=ns_id, parent_key=parent_key, keys=keys[start:start + group],
                                        page_bytes=page_bytes)
            return time.monotonic(), self.control.start("Reserve", request)

        states: list[int] = []
        committed: list[int] = []
        leases: list[int] = []
        commit: GrpcCall | None = None
        sent_at, next_reserve = reserve(0, parent)
        try:
            for start in range(0, len(keys), group):
                reserved = next_reserve.result()
                group_states = list(reserved.states)
                states += group_states
                chain_goes_on = all(state in _STORED_STATES for state in group_states)
                if start + group < len(keys) and chain_goes_on:
                    group_sent_at = sent_at
                    sent_at, next_reserve = reserve(start + group, keys[start + group - 1])
                else:
                    group_sent_at = sent_at
                indices = [i for i, state in enumerate(group_states) if state == pb.RESERVED]
                if reserved.lease_id:
                    leases.append(reserved.lease_id)
                move_until = group_sent_at + reserved.lease_ttl_ms / 1000 - LEASE_MARGIN_S
                for first in range(0, len(indices), run):
                    chunk = indices[first:first + run]
                    if time.monotonic() > move_until:
                        raise errors.LeaseNotFound("the write lease would expire before the pages moved; "
                                                   "raise leases.write_ttl_ms or put fewer pages per call")
                    pages = [(reserved.first_index + i, reserved.offsets[i], segments[start + i]) for i in chunk]
                    self.data.put(reserved.lease_id, reserved.data_token, pages, page_bytes)
                    sums = [checksum(segments[start + i]) for i in chunk] if verify else []
                    if commit is not None:
                        committed += commit.result().states
                    commit = self.control.start("Commit", pb.CommitRequest(
                        lease_id=reserved.lease_id, indices=[reserved.first_index + i for i in chunk],
                        checksums=sums))
                if not chain_goes_on:
                    break
            if commit is not None:
                committed += commit.result().states
        except BaseException:
            for lease_id in leases:
                self.control.post("Abort", pb.AbortRequest(lease_id=lease_id))
            raise
        return _stored(states, committed)

    def get_batch(self, request: pb.AcquireRequest, segments: list[list[Segment]], verify: bool) -> int:
        """Acquire (the request names namespace, keys and prefetch policy), move the hits, release."""
        sent_at = time.monotonic()
        acquired = self.control.call("Acquire", request)
        hits = acquired.hit_pages
        if not hits:
            return 0
        try:
            pages = [(i, acquired.offsets[i], segments[i]) for i in range(hits)]
            self.data.get(acquired.lease_id, acquired.data_token, pages, acquired.page_bytes)
        finally:
            self.control.post("Release", pb.ReleaseRequest(lease_ids=[acquired.lease_id]))
        if time.monotonic() > sent_at + acquired.lease_ttl_ms / 1000:
            raise errors.LeaseNotFound("the read lease expired during the transfer; the pages may be torn")
        if verify:
            for i in range(hits):
                if checksum(segments[i]) != acquired.checksums[i]:
                    raise errors.ChecksumMismatch(f"page {i} does not match its checksum")
        return hits

    def close(self) -> None:
        self.data.close()


def _stored(states: list[int], committed: list[int]) -> int:
    """Leading keys stored: present, in flight elsewhere, or reserved here and committed."""
    answers = iter(committed)
    stored = 0
    for state in states:
        if state not in _STORED_STATES:
            break
        if state == pb.RESERVED and next(answers, None) != pb.COMMITTED:
            break
        stored += 1
    return stored
