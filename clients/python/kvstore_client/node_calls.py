"""Every call of a node client, written once: what it sends, in which order, and what the answers mean.

Each function here is a call (node_steps.py): a generator that checks its arguments before anything is
sent, then yields OnNode steps whose attempts yield the messages and page moves. KVStoreClient drives
them with blocking I/O and AsyncKVStoreClient awaits them, so both offer the same methods, arguments,
results and errors; the cluster clients route over node clients of either kind.

An attempt may be repeated on a new connection when the node was lost under it (OnNode.retry): the
reads (get, lookup, held, route, the listings, stats) always; a put's batch while none of its pages
was given a slot (its bytes may be in a node that is gone); never a delete, a stage or a commit.
A namespace is opened on a connection the first time an attempt needs its id, and once more when
the node no longer knows it (it restarted): in_namespace.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

from kvstore_client import errors, groups
from kvstore_client.arguments import (engine_id_list, get_pages, keys_or_tokens, parent_list, prefetch_policy,
                                      put_pages)
from kvstore_client.events import PageSnapshot, page_snapshot
from kvstore_client.groups import GroupHits, GroupPart, StagedPages
from kvstore_client.keys import Key, Namespace, encode_key, encode_keys
from kvstore_client.lookup import Chain, held_each, leading_hits, lookup_chain, residency_of, tiers_each_of
from kvstore_client.node_steps import GetPages, OnNode, Steps, call
from kvstore_client.pipeline import PutBatch, PutResult, get_batch
from kvstore_client.proto import pb
from kvstore_client.load_estimate import NO_COSTS, LoadCosts
from kvstore_client.residency import Leading, Residency

log = logging.getLogger(__name__)

HotPages = Callable[[Namespace, list[tuple[bytes, int]]], None]


# -- pages ------------------------------------------------------------------------------

def put(namespace: Namespace, keys: Sequence[Key] | None, buffers: Any, parent: Key | None, verify: bool,
        durable: bool, tokens: Any, anchor: Key | None, parents: Sequence[Key | None] | None) -> Steps[PutResult]:
    """KVStoreClient.put: one attempt per batch of limits.batch_pages_max keys, each continuing the chain."""
    raw_keys, segments, keepalive = put_pages(namespace, keys, buffers, tokens, parent, anchor)
    raw_parents = parent_list(parents, len(raw_keys), parent, anchor)
    parent_key = encode_key(parent) if parent is not None else b""
    anchor_key = encode_key(anchor) if anchor is not None else b""
    stored = 0
    for start, stop in _batches(len(raw_keys), (yield from _limits()).batch_pages_max):
        batch = PutBatch(namespace.page_bytes, parent_key, raw_keys[start:stop], segments[start:stop], verify,
                         durable, anchor=anchor_key, parents=raw_parents[start:stop] if raw_parents is not None else None)
        anchor_key = b""
        batch_stored = yield OnNode(lambda conn: in_namespace(conn, namespace, lambda ns_id: batch.steps(conn, ns_id)),
                                    retry=lambda: not batch.slots_reserved, needs_data=True)
        stored += batch_stored
        if batch_stored < stop - start:
            return PutResult(stored, len(raw_keys), getattr(batch_stored, "reason", ""))
        parent_key = raw_keys[stop - 1]
    del keepalive
    return PutResult(stored, len(raw_keys))


def get(namespace: Namespace, keys: Sequence[Key] | None, out: Any, verify: bool, policy: str, timeout_ms: int,
        tokens: Any, wait_ms: int, on_hot: HotPages | None) -> Steps[int]:
    """KVStoreClient.get: one attempt per batch, until a batch is not wholly hit."""
    prefetch = prefetch_policy(policy)
    raw_keys, segments, keepalive = get_pages(namespace, keys, out, tokens)
    hot = (lambda pages: on_hot(namespace, pages)) if on_hot is not None else None
    loaded = 0
    for start, stop in _batches(len(raw_keys), (yield from _limits()).batch_pages_max):
        def in_namespace_id(conn: Any, ns_id: int) -> Steps[int]:
            request = pb.AcquireRequest(namespace_id=ns_id, policy=prefetch, timeout_ms=timeout_ms, wait_ms=wait_ms)
            return get_batch(request, raw_keys[start:stop], segments[start:stop], verify, hot)(conn)
        batch_loaded = yield OnNode(lambda conn: in_namespace(conn, namespace, lambda ns_id: in_namespace_id(
            conn, ns_id)), needs_data=True)
        loaded += batch_loaded
        if batch_loaded < stop - start:
            break
    del keepalive
    return loaded


# -- lookups ----------------------------------------------------------------------------

def lookup(namespace: Namespace, keys: Sequence[Key] | None, tokens: Any) -> Steps[int]:
    """KVStoreClient.lookup: a prompt of any length in one attempt, its parts sent at once (lookup.py)."""
    chain = lookup_chain(namespace, keys, tokens)
    if tokens is not None and not chain:
        return 0   # fewer tokens than one page
    return (yield OnNode(lambda conn: in_namespace(conn, namespace, lambda ns_id: leading_hits(
        conn.hello.limits, ns_id, chain, conn.control.answers_in_order))))


def held(namespace: Namespace, keys: Sequence[Key]) -> Steps[list[bool]]:
    raw = encode_keys(keys)
    return (yield OnNode(lambda conn: in_namespace(conn, namespace, lambda ns_id: held_each(
        conn.hello.limits, ns_id, raw))))


def residency(namespace: Namespace, keys: Sequence[Key] | None, tokens: Any, engine_ids: Sequence[str]
              ) -> Steps[Residency]:
    """KVStoreClient.residency: the store's prefix by tier and each engine's, one attempt (lookup.residency_of)."""
    chain = lookup_chain(namespace, keys, tokens)
    ids = engine_id_list(engine_ids)
    if tokens is not None and not chain:
        return Leading(ids).residency()   # fewer tokens than one page
    return (yield OnNode(lambda conn: in_namespace(conn, namespace, lambda ns_id: residency_of(
        conn.hello.limits, ns_id, chain, ids, getattr(conn, "transfer", None), conn.control.answers_in_order))))


def tiers_each(namespace: Namespace, chain: Chain, engine_ids: list[str]) -> Steps[tuple[bytes, dict, LoadCosts]]:
    """Where each page of a chain is on the node, the engines' prefixes of it and what loading costs
    (lookup.tiers_each_of)."""
    if not len(chain):
        return b"", Leading(engine_ids).engines_held(), NO_COSTS
    return (yield OnNode(lambda conn: in_namespace(conn, namespace, lambda ns_id: tiers_each_of(
        conn.hello.limits, ns_id, chain, engine_ids, getattr(conn, "transfer", None),
        conn.control.answers_in_order))))


def route(namespace: Namespace, engine_ids: Sequence[str], keys: Sequence[Key] | None, tokens: Any
          ) -> Steps[pb.RouteResponse]:
    request = pb.RouteRequest(**keys_or_tokens(keys, tokens), engine_ids=engine_id_list(engine_ids))
    return (yield OnNode(lambda conn: call_in(conn, namespace, "Route", request)))


# -- removal ----------------------------------------------------------------------------

def delete(namespace: Namespace, keys: Sequence[Key]) -> Steps[int]:
    request = pb.DeleteRequest(keys=encode_keys(keys))
    return (yield OnNode(lambda conn: call_in(conn, namespace, "Delete", request), retry=False)).deleted_pages


def removing(namespace: Namespace, keys: Sequence[Key]) -> Steps[tuple[int, list[bytes], bool]]:
    """delete(), answering also the removed pages' keys: (pages removed, their keys, whether more were removed
    than the keys name). A cluster's delete asks the other nodes for pages anchored at them."""
    raw, step = encode_keys(keys), (yield from _limits()).batch_pages_max
    removed, named, cut = 0, [], False
    for start in range(0, len(raw), step):
        request = pb.DeleteRequest(keys=raw[start:start + step], report_keys=True)
        answer = yield OnNode(lambda conn: call_in(conn, namespace, "Delete", request), retry=False)
        removed += answer.deleted_pages
        named += answer.removed_keys
        cut = cut or answer.removed_keys_cut
    return removed, named, cut


def clear(namespace: Namespace) -> Steps[int]:
    request = pb.DeleteRequest(all_pages=True)
    return (yield OnNode(lambda conn: call_in(conn, namespace, "Delete", request), retry=False)).deleted_pages


# -- listings ---------------------------------------------------------------------------

def list_keys(namespace: Namespace) -> Steps[list[bytes]]:
    def in_namespace_id(ns_id: int) -> Steps[list[bytes]]:
        answers = yield from _every_page(lambda cursor: pb.ListKeysRequest(namespace_id=ns_id, cursor=cursor),
                                         "ListKeys")
        return sorted({key for answer in answers for key in answer.keys})
    return (yield OnNode(lambda conn: in_namespace(conn, namespace, in_namespace_id)))


def list_pages(namespace: Namespace) -> Steps[PageSnapshot]:
    def in_namespace_id(ns_id: int) -> Steps[PageSnapshot]:
        return page_snapshot(ns_id, (yield from _every_page(
            lambda cursor: pb.ListPagesRequest(namespace_id=ns_id, cursor=cursor), "ListPages")))
    return (yield OnNode(lambda conn: in_namespace(conn, namespace, in_namespace_id)))


def events_run(namespace: Namespace) -> Steps[bytes]:
    return (yield OnNode(lambda conn: in_namespace(conn, namespace, lambda ns_id: call(
        "ListPages", pb.ListPagesRequest(namespace_id=ns_id, pages_max=1))))).events_run


def stats() -> Steps[pb.StatsResponse]:
    return (yield OnNode(lambda conn: call("Stats", pb.StatsRequest())))


# -- page groups (groups.py): the parts of one position, visible and read together -----

def stage(namespace: Namespace, keys: Sequence[Key] | None, buffers: Any, parent: Key | None, verify: bool,
          tokens: Any, anchor: Key | None, parents: Sequence[Key | None] | None) -> Steps[StagedPages]:
    """KVStoreClient.stage: one write lease's pages copied into their slots, none visible yet."""
    raw_keys, segments, keepalive = put_pages(namespace, keys, buffers, tokens, parent, anchor)
    raw_parents = parent_list(parents, len(raw_keys), parent, anchor) or []
    most = (yield from _limits()).batch_pages_max
    if len(raw_keys) > most:
        raise errors.InvalidArgument(f"{len(raw_keys)} keys: a staged part is one write lease of at most "
                                     f"{most} pages (limits.batch_pages_max)")
    before = anchor if anchor is not None else parent
    before_key = encode_key(before) if before is not None else b""
    staged = yield OnNode(lambda conn: in_namespace(conn, namespace, lambda ns_id: groups.stage_batch(
        conn, ns_id, namespace, raw_keys, segments, before_key, anchor is not None, verify, raw_parents)),
        retry=False, needs_data=True)
    del keepalive
    return staged


def commit_group(parts: Sequence[StagedPages]) -> Steps[list[PutResult]]:
    """KVStoreClient.commit_group: one CommitGroup; a refused group has every lease aborted, then its error raised."""
    request = groups.commit_group_request(parts)
    if request is not None:
        try:
            yield OnNode(lambda conn: call("CommitGroup", request), retry=False)
        except BaseException:
            yield from _abort_quietly([part.lease_id for part in request.parts])
            raise
    return groups.committed(parts)


def abort_staged(parts: Sequence[StagedPages]) -> Steps[None]:
    lease_ids = {part.lease_id for part in parts if part.lease_id and part.slots}
    for part in parts:
        part.slots.clear()
    yield from _abort_quietly(sorted(lease_ids))


def put_group(keys: Sequence[Key], parts: Sequence[tuple[Namespace, Any]], parent: Key | None, verify: bool,
              anchor: Key | None) -> Steps[PutResult]:
    """KVStoreClient.put_group: every part staged, then one commit; the leading keys stored in every part."""
    if not parts:
        raise errors.InvalidArgument("put_group needs at least one (namespace, pages) part")
    staged: list[StagedPages] = []
    try:
        for namespace, buffers in parts:
            staged.append((yield from stage(namespace, keys, buffers, parent, verify, None, anchor, None)))
    except BaseException:
        yield from abort_staged(staged)
        raise
    return min((yield from commit_group(staged)), key=int)


def lookup_group(keys: Sequence[Key], parts: Sequence[GroupPart]) -> Steps[GroupHits]:
    def attempt(conn: Any) -> Steps[GroupHits]:
        request = groups.lookup_group_request(keys, parts, conn.hello.limits)

        def in_namespace_ids(ns_ids: list[int]) -> Steps[GroupHits]:
            for part, ns_id in zip(request.parts, ns_ids):
                part.namespace_id = ns_id
            return groups.group_hits((yield from call("LookupGroup", request)))
        return (yield from in_namespaces(conn, [part.namespace for part in parts], in_namespace_ids))
    return (yield OnNode(attempt))


def get_group(parts: Sequence[tuple[Namespace, Sequence[Key], Any]], verify: bool, policy: str) -> Steps[list[int]]:
    """KVStoreClient.get_group: every part pinned in one AcquireGroup, a key loaded in every part or in none."""
    prefetch = prefetch_policy(policy)
    if not parts:
        raise errors.InvalidArgument("get_group needs at least one (namespace, keys, out) part")
    prepared = [get_pages(namespace, part_keys, out, None) for namespace, part_keys, out in parts]
    part_segments = [segments for _, segments, _ in prepared]

    def in_namespace_ids(ns_ids: list[int]) -> Steps[list[int]]:
        request = pb.AcquireGroupRequest(parts=[
            pb.AcquireRequest(namespace_id=ns_id, keys=raw_keys, policy=prefetch)
            for ns_id, (raw_keys, _, _) in zip(ns_ids, prepared)])
        sent_at = time.monotonic()
        acquired = yield from call("AcquireGroup", request)
        landed: dict[int, list[int] | None] = {}
        try:
            counts = groups.whole_positions([raw_keys for raw_keys, _, _ in prepared],
                                            [answer.hit_pages for answer in acquired.parts])
            for load in groups.part_loads(acquired, counts, part_segments):
                landed[load[0]] = yield GetPages(*load)
        finally:
            changed = yield from groups.release(acquired, landed)
        groups.check_group_loaded(acquired, counts, part_segments, sent_at, verify, changed)
        return counts
    counts = yield OnNode(lambda conn: in_namespaces(conn, [namespace for namespace, _, _ in parts],
                                                     in_namespace_ids), needs_data=True)
    return counts


# -- attempts' parts --------------------------------------------------------------------

def in_namespace(conn: Any, namespace: Namespace, body: Callable[[int], Steps[Any]]) -> Steps[Any]:
    """Run body(namespace id), the namespace opened on this connection first (again, once, if the node forgot
    it: it restarted)."""
    for attempt in (1, 2):
        ns_id = conn.namespace_ids.get(namespace)
        if ns_id is None:
            opened = yield from call("OpenNamespace", pb.OpenNamespaceRequest(spec=namespace.to_proto()))
            ns_id = conn.namespace_ids[namespace] = opened.namespace_id
        try:
            return (yield from body(ns_id))
        except errors.NamespaceNotFound:
            conn.namespace_ids.pop(namespace, None)
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def in_namespaces(conn: Any, namespaces: Sequence[Namespace], body: Callable[[list[int]], Steps[Any]]) -> Steps[Any]:
    """Run body(namespace ids), each namespace opened as in_namespace."""
    def nest(rest: Sequence[Namespace], ids: list[int]) -> Steps[Any]:
        if not rest:
            return body(ids)
        return in_namespace(conn, rest[0], lambda ns_id: nest(rest[1:], [*ids, ns_id]))
    return (yield from nest(list(namespaces), []))


def call_in(conn: Any, namespace: Namespace, method: str, request: Any) -> Steps[Any]:
    """A namespace-scoped message, its namespace_id filled in."""
    def in_namespace_id(ns_id: int) -> Steps[Any]:
        request.namespace_id = ns_id
        return (yield from call(method, request))
    return (yield from in_namespace(conn, namespace, in_namespace_id))


def _every_page(request: Callable[[int], Any], method: str) -> Steps[list[Any]]:
    """Every answer of a call paged by a cursor (ListKeys, ListPages): from 0 until one says no more."""
    answers, cursor = [], 0
    while True:
        answers.append((yield from call(method, request(cursor))))
        if not answers[-1].more:
            return answers
        cursor = answers[-1].cursor


def _abort_quietly(lease_ids: Sequence[int]) -> Steps[None]:
    """Abort write leases; one the node no longer holds (expired, or the node restarted) is gone already."""
    for lease_id in lease_ids:
        try:
            yield OnNode(lambda conn: call("Abort", pb.AbortRequest(lease_id=lease_id)), retry=False)
        except errors.KVStoreError as exc:
            log.info("staged lease %#x not aborted (%s): the node ends it at its TTL", lease_id, exc)


def _limits() -> Steps[pb.Limits]:
    """The node's limits, as its Hello gave them on the standing connection."""
    return (yield OnNode(_hello_limits))


def _hello_limits(conn: Any) -> Steps[pb.Limits]:
    return conn.hello.limits
    yield   # an attempt without a message


def _batches(count: int, step: int) -> list[tuple[int, int]]:
    return [(start, min(start + step, count)) for start in range(0, count, step)]

