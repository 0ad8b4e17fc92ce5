"""The ENGINE tier index rebuilds our key chain from engine blocks and forgets what engines drop."""

import pytest

from kvstore.control import engine_index
from kvstore.control.engine_index import GPU, HOST, Cleared, EngineIndex, Removed, Stored
from kvstore.control.key_sets import KeySet, PyKeySet
from kvstore_client.keys import encode_key, prefix_hashes

BLOCK = 4
TOKENS = list(range(100, 124))                        # 6 blocks of 4
KEYS = [encode_key(k) for k in prefix_hashes(TOKENS, BLOCK)]


def stored(hashes, parent, first_block, medium="GPU", **extra):
    tokens = TOKENS[first_block * BLOCK:(first_block + len(hashes)) * BLOCK]
    return Stored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BLOCK,
                  medium=medium, **extra)


def test_blocks_get_our_keys_across_batches():
    index = EngineIndex(blocks_max=100)
    index.apply("e1", [stored([11, 12], None, 0)])
    index.apply("e1", [stored([13, 14], 12, 2)])     # continues from the parent's key
    places = index.holders(KEYS, ["e1", "e2"])
    assert places["e1"] == [GPU] * 4 + [None, None]
    assert places["e2"] == [None] * 6
    assert index.counters["e1"].stored == 4 and len(index) == 4


def test_removed_and_cleared_forget_blocks():
    index = EngineIndex(blocks_max=100)
    index.apply("e1", [stored([11, 12, 13], None, 0), stored([21], None, 0, medium="CPU")])
    assert index.holders(KEYS[:1], ["e1"])["e1"] == [GPU]        # GPU wins over the host copy
    index.apply("e1", [Removed(block_hashes=[11, 13], medium="GPU")])
    assert index.holders(KEYS[:3], ["e1"])["e1"] == [HOST, GPU, None]
    index.apply("e1", [Cleared()])
    assert index.holders(KEYS[:3], ["e1"])["e1"] == [None] * 3
    assert len(index) == 0


def test_block_with_unknown_parent_is_an_orphan():
    index = EngineIndex(blocks_max=100)
    index.apply("e1", [stored([13, 14], 999, 2)])
    assert index.counters["e1"].orphans == 2 and index.counters["e1"].unattributable == 2 and len(index) == 0


def test_blocks_whose_hash_covers_more_than_tokens_are_counted_never_indexed():
    index = EngineIndex(blocks_max=100)
    index.apply("e1", [stored([11], None, 0, plain=False), stored([31], None, 0, medium="DISK"),
                       stored([41], None, 0, group_idx=1)])
    counters = index.counters["e1"]
    assert (counters.seen, counters.unattributable, counters.not_in_memory) == (3, 1, 2) and len(index) == 0


def test_bigram_pages_and_a_second_block_size_are_unattributable():
    index = EngineIndex(blocks_max=100)
    index.apply("e1", [stored([11], None, 0)])
    assert index.block_tokens("e1") == BLOCK
    pairs = [[t, t + 1] for t in range(BLOCK)]
    index.apply("e1", [Stored(block_hashes=[12], parent_block_hash=11, token_ids=pairs, block_size=BLOCK),
                       Stored(block_hashes=[13], parent_block_hash=11, token_ids=list(range(2 * BLOCK)),
                              block_size=2 * BLOCK)])
    counters = index.counters["e1"]
    assert (counters.seen, counters.stored, counters.unattributable) == (3, 1, 2) and len(index) == 1
    assert [(engine, pages, c.unattributable) for engine, pages, c in index.snapshot()] == [("e1", 1, 2)]


def test_token_count_must_match_blocks():
    index = EngineIndex(blocks_max=100)
    index.apply("e1", [Stored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 2, 3], block_size=BLOCK)])
    assert len(index) == 0 and index.counters["e1"].unattributable == 2


def test_index_is_bounded():
    index = EngineIndex(blocks_max=3)
    index.apply("e1", [stored([11, 12, 13, 14, 15], None, 0)])
    assert len(index) == 3 and index.counters["e1"].dropped_full == 2


def test_hash_seed_starts_the_chain():
    seed = "ab" * 32
    index = EngineIndex(blocks_max=10, hash_seed=seed)
    index.apply("e1", [stored([11], None, 0)])
    seeded = encode_key(prefix_hashes(TOKENS[:BLOCK], BLOCK, seed)[0])
    assert index.holders([seeded, KEYS[0]], ["e1"])["e1"] == [GPU, None]


def test_same_key_under_two_engine_hashes_is_counted_twice():
    index = EngineIndex(blocks_max=10)
    index.apply("e1", [stored([11], None, 0), stored([12], None, 0)])
    index.apply("e1", [Removed(block_hashes=[11], medium="GPU")])
    assert index.holders(KEYS[:1], ["e1"])["e1"] == [GPU]


def test_a_lookahead_block_counts_only_where_the_request_goes_on_with_its_tokens():
    index = EngineIndex(blocks_max=100)
    lookahead = [TOKENS[(b + 1) * BLOCK:(b + 1) * BLOCK + 2] for b in range(3)]
    index.apply("e1", [Stored(block_hashes=[11, 12, 13], parent_block_hash=None, token_ids=TOKENS[:3 * BLOCK],
                              block_size=BLOCK, lookahead=lookahead)])
    # The engine holds pages 0-2; page 2's drafter KV assumed the two tokens after it.
    assert index.holders(KEYS, ["e1"], TOKENS, BLOCK)["e1"] == [GPU] * 3 + [None] * 3
    other = TOKENS[:3 * BLOCK] + [7, 7] + TOKENS[3 * BLOCK + 2:]
    assert index.holders(KEYS[:3] + [b"x"], ["e1"], other, BLOCK)["e1"] == [GPU, GPU, None, None]
    assert index.holders(KEYS[:3], ["e1"])["e1"] == [GPU, GPU, None]   # by keys alone: cannot tell


def test_blocks_of_another_size_than_the_subscription_declares_are_refused():
    index = EngineIndex(blocks_max=100, block_tokens={"e1": 2 * BLOCK})
    assert index.block_tokens("e1") == 2 * BLOCK and index.block_tokens("e2") == 0   # known before any event
    index.apply("e1", [stored([11, 12], None, 0)])
    index.apply("e2", [stored([11, 12], None, 0)])
    counters = index.counters["e1"]
    assert (counters.seen, counters.refused, counters.stored, counters.block_tokens) == (2, 2, 0, BLOCK)
    assert index.holders(KEYS[:2], ["e1", "e2"]) == {"e1": [None, None], "e2": [GPU, GPU]}


def test_blocks_of_wide_token_ids_get_sglangs_keys_and_ids_no_chain_hashes_are_unattributable():
    """A multimodal pad value past uint32 is keyed as SGLang keys it; a negative id or one past
    int64 names no page of the chain, so its block is counted, never indexed, and nothing raises."""
    wide = [2**40 + 5, 1, 2**62 - 1, 3]
    index = EngineIndex(blocks_max=100)
    index.apply("e1", [Stored(block_hashes=[11], parent_block_hash=None, token_ids=wide, block_size=BLOCK),
                       Stored(block_hashes=[12], parent_block_hash=None, token_ids=[-1, 2, 3, 4], block_size=BLOCK),
                       Stored(block_hashes=[13], parent_block_hash=None, token_ids=[2**63, 2, 3, 4],
                              block_size=BLOCK)])
    assert index.holders([encode_key(prefix_hashes(wide, BLOCK)[0])], ["e1"])["e1"] == [GPU]
    assert index.counters["e1"].unattributable == 2 and len(index) == 1


@pytest.mark.parametrize("key_set", sorted({KeySet, PyKeySet}, key=lambda kind: kind.__name__))
def test_leading_runs_agree_with_each_keys_holders_under_random_events(key_set, monkeypatch):
    """leading() walks each engine's KeySet (the native one and the Python one), by a list of keys and by
    the same keys packed; holders() names each key's place one by one: they must agree on every chain,
    whatever mix of stores, removals and clears came before."""
    import random

    monkeypatch.setattr(engine_index, "KeySet", key_set)
    rng = random.Random(3)
    index = EngineIndex(blocks_max=10_000)
    hashes = {engine: iter(range(base, base + 100_000)) for engine, base in (("e1", 0), ("e2", 10**6))}
    announced = {"e1": [], "e2": []}
    for _ in range(400):
        engine = rng.choice(["e1", "e2"])
        op = rng.random()
        if op < 0.6:
            first = rng.randrange(len(KEYS))
            count = rng.randint(1, len(KEYS) - first)
            parent = None if first == 0 else next((h for h, b in announced[engine] if b == first - 1), None)
            if first and parent is None:
                continue
            block_hashes = [next(hashes[engine]) for _ in range(count)]
            medium = rng.choice(["GPU", "CPU"])
            index.apply(engine, [stored(block_hashes, parent, first, medium=medium)])
            announced[engine] += [(h, first + i) for i, h in enumerate(block_hashes)]
        elif op < 0.95 and announced[engine]:
            gone = rng.sample(announced[engine], min(len(announced[engine]), rng.randint(1, 3)))
            medium = rng.choice(["GPU", "CPU"])
            index.apply(engine, [Removed(block_hashes=[h for h, _ in gone], medium=medium)])
        else:
            index.apply(engine, [Cleared()])
        for chain in (KEYS, KEYS[:3], KEYS[2:] + KEYS[:2], KEYS + KEYS[:1]):
            places = index.holders(chain, ["e1", "e2", "e3"])
            expected = []
            for engine in ("e1", "e2", "e3"):
                held = next((i for i, place in enumerate(places[engine]) if place is None), len(chain))
                gpu = next((i for i, place in enumerate(places[engine]) if place != GPU), len(chain))
                expected.append((gpu, held))
            assert index.leading(chain, ["e1", "e2", "e3"]) == expected
            assert index.leading(b"".join(chain), ["e1", "e2", "e3"], key_bytes=len(chain[0])) == expected
