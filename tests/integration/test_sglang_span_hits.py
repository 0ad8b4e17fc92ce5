"""A group lookup over a span longer than one LookupGroup holds, window by window, answers as one lookup
of the whole span would: checked against groups.fold over the whole span, on random presence."""

import random

import pytest

from sglang_harness import import_sglang

import_sglang()   # sglang_pools speaks SGLang's pool types
from kvstore_client.groups import fold  # noqa: E402
from kvstore_client.adapters.sglang_pools import span_hits  # noqa: E402
from kvstore_client.groups import HIT_POLICIES, GroupHits, GroupPart  # noqa: E402
from kvstore_client.keys import Namespace  # noqa: E402
from kvstore_client.proto import pb  # noqa: E402


def answer(present: dict[int, list[bool]], parts, keys):
    """What a node answers for `keys` (positions), from which pages each part holds."""
    proto = [pb.GroupPart(hit_policy=HIT_POLICIES[p.hit_policy], trailing_pages=p.trailing_pages) for p in parts]
    kv = present[id(parts[0])]
    leading = next((n for n, k in enumerate(keys) if not kv[k]), len(keys))
    found = [[present[id(p)][k] for k in keys[:leading]] for p in parts[1:]]
    hits = fold(leading, found, proto)
    return GroupHits(hits.hit_pages, hits.part_hit_pages, hits.restorable_pages)


@pytest.mark.parametrize("seed", range(200))
def test_windows_answer_as_one_lookup_of_the_whole_span(seed):
    rng = random.Random(seed)
    ns = Namespace(model="m", page_bytes=4096)
    length, window = rng.randint(1, 60), rng.randint(4, 12)
    parts = [GroupPart(ns)] + [GroupPart(ns, "trailing_pages", rng.randint(1, 3)) if rng.random() < 0.5
                               else GroupPart(ns) for _ in range(rng.randint(0, 3))]
    holes = rng.random() * 0.2
    present = {id(p): [rng.random() > holes for _ in range(length)] for p in parts}
    positions = list(range(length))
    whole = answer(present, parts, positions)
    windowed = span_hits(lambda keys, ps: answer(present, ps, keys), positions, parts, window)
    assert windowed == whole
