"""Which pages the HBM tier should copy in: a replay of chat traffic against the admission rules.

    python bench/hbm_policy.py [--requests 40000] [--pool-share 0.1] [--seed 1]

Traffic: conversations on system prompts (Zipf; 80% of conversations on 10 prompts of 64 pages each,
the rest on 200 others), each turn reading the whole chain so far (system prompt + its own history,
2-8 new pages a turn, 1-10 turns); new conversations arrive while old ones go on. Every read is of a
chain from its first page, as an engine's prefix lookup is. The pool holds --pool-share of the pages
the traffic touches; copies leave leaf-first, least recently read first, as store_hbm.py does.

Rules compared (what each copy costs: one page over PCIe into the pool):
  every-read    copy a page the first time it is read
  second-read   copy a page once it has been read twice (hbm.promote_hits = 2, the node's default)
  third-read    hbm.promote_hits = 3
Printed per rule: the share of page reads answered from the pool, copies per page read, and the share of
copies that were never read from the pool before they left (wasted PCIe traffic).
"""

from __future__ import annotations

import argparse
import collections
import random


def conversations(rng: random.Random, requests: int):
    """Yield each request's chain (a list of page ids, first page first)."""
    hot, cold = [f"s{i}" for i in range(10)], [f"c{i}" for i in range(200)]
    weights = [1 / (rank + 1) for rank in range(len(cold))]
    live: list[list] = []
    made = 0
    while made < requests:
        if len(live) < 64 or rng.random() < 0.3:
            prompt = rng.choice(hot) if rng.random() < 0.8 else rng.choices(cold, weights)[0]
            live.append([[(prompt, i) for i in range(64)], rng.randint(1, 10), f"u{made}"])
        conversation = rng.choice(live)
        chain, turns_left, name = conversation
        chain += [(name, len(chain) + i) for i in range(rng.randint(2, 8))]
        conversation[1] -= 1
        if conversation[1] == 0:
            live.remove(conversation)
        made += 1
        yield list(chain)


def replay(chains: list[list], pool_pages: int, promote_hits: int) -> tuple[float, float, float]:
    hits: collections.Counter = collections.Counter()
    pool: collections.OrderedDict = collections.OrderedDict()   # page -> reads answered from the pool; LRU first
    children: collections.Counter = collections.Counter()
    parent_of: dict = {}
    read = answered = copies = wasted = 0
    for chain in chains:
        for position, page in enumerate(chain):
            parent_of[page] = chain[position - 1] if position else None
            read += 1
            hits[page] += 1
            if page in pool:
                answered += 1
                pool[page] += 1
                pool.move_to_end(page)
        for page in chain:   # the mover's pass after the read: parents first
            if page in pool or hits[page] < promote_hits:
                continue
            parent = parent_of[page]
            if parent is not None and parent not in pool:
                break
            while len(pool) >= pool_pages:
                victim = next((p for p in pool if not children[p] and p not in chain), None)
                if victim is None:
                    break
                wasted += pool.pop(victim) == 0
                if parent_of[victim] is not None:
                    children[parent_of[victim]] -= 1
            if len(pool) >= pool_pages:
                break
            pool[page] = 0
            copies += 1
            if parent is not None:
                children[parent] += 1
    return answered / read, copies / read, wasted / max(copies, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40000)
    parser.add_argument("--pool-share", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    chains = list(conversations(random.Random(args.seed), args.requests))
    touched = len({page for chain in chains for page in chain})
    pool_pages = max(1, int(touched * args.pool_share))
    print(f"{args.requests} requests, {sum(map(len, chains))} page reads, {touched} pages touched, "
          f"pool {pool_pages} pages ({args.pool_share:.0%})")
    print(f"{'rule':12} {'read from HBM':>14} {'copies/read':>12} {'copies never read':>18}")
    for name, promote_hits in (("every-read", 1), ("second-read", 2), ("third-read", 3)):
        share, cost, wasted = replay(chains, pool_pages, promote_hits)
        print(f"{name:12} {share:>14.3f} {cost:>12.4f} {wasted:>18.3f}")


if __name__ == "__main__":
    main()
