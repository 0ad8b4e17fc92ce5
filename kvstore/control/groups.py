"""Page groups: which prefixes of a chain can be restored whole, over several namespaces at once.

A hybrid model keeps, for one position of a prompt (one page of tokens), a KV page and sidecar
pages beside it (Mamba/SSM state, sliding-window KV, the DSA indexer, draft-model pages), each
in a namespace of its own (its own page size), all named by the same prefix key. Those pages
are the position's group. The store makes a group visible in one step (PageStore.commit_group)
and answers a lookup over it from one snapshot (PageStore.group_presence); this module turns
that snapshot into the answer, with the hit policies SGLang's pools declare:

- the first part (the KV pool) bounds the answer with its leading pages, as a Lookup does;
- a GROUP_ALL_PAGES part accepts a prefix when every page of it is present;
- a GROUP_TRAILING_PAGES part accepts a prefix when its last `trailing_pages` pages are present
  (a state that summarises everything before it needs only the pages at the cut).

A prefix is restorable when every part accepts it. Once no prefix is left, later parts are not
weighed (each answers 0), as SGLang's own backends answer.

Membership is not stored: the parts of a position are the pages of the same key in the group's
namespaces, which the caller names. So eviction stays what it is per namespace (leaf-first LRU,
prefix-closed; index.py knows nothing of groups), and each part is evicted on its own. That is
safe because every read of a group goes through the group calls: a position with a part gone is
simply not restorable (a lookup answers it absent, an acquire stops that part there), never a
partial hit. What it costs is bytes: the parts left of a broken position stay until they are
least recently used leaves themselves, and a position is lost when its first part goes rather
than its last.

Pure functions: no lock, no store.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from kvstore_client.proto import pb


@dataclasses.dataclass(frozen=True)
class GroupHits:
    hit_pages: int               # the longest restorable prefix
    part_hit_pages: list[int]    # each part's own longest accepted prefix (0 once nothing is left)
    restorable_pages: list[int]  # every restorable prefix length, ascending


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
