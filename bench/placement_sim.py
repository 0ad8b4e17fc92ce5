"""Which unit of placement a kvstore cluster should use: a simulation of candidate schemes.

    python bench/placement_sim.py [--nodes 100] [--requests 20000] [--json bench/results/placement_sim.json]
                                  [--clients 16] [--rate 100] [--hot-reads 4] [--hot-half-life 60]

Workload: `--conversations` conversations, each a chain of pages: 80% start with one of
10 system prompts (chosen Zipf(1.2) among the 10, 8-32 pages each), then 8-64 pages of
their own; requests pick a conversation Zipf(1.1) and read its whole chain. Every node has
the same capacity. Placement is weighted rendezvous hashing (as kvstore_client/placement.py,
with a vectorized 64-bit mix instead of blake2b so 100 nodes x 10^5 keys runs in seconds).

Schemes:
  page          each page on the node its own key picks (what kvstore_client/placement.py does, with the
                leading pages of a chain's first put also on 3 nodes)
  chain         a conversation's whole chain on the node its first key picks
  segK          chain segments of K pages, each on the node its first key picks
  segK+rRxS     segK, the first S segments (S=1 if left out) each on the R highest-scoring nodes,
                reads spread over them: shared prefixes sit at the start of chains
  segK+hotR     segK, the hottest 1% of segments (by this run's own reads: an oracle, the
                bound of replication driven by measured popularity) on R nodes each
  page+popR     what kvstore builds (kvstore/control/read_heat.py, kvstore_client/hot_pages.py), online:
                each page on its best node; each node keeps a read count per page, decayed with
                --hot-half-life seconds (requests arrive at --rate per second); a read that finds the
                count at --hot-reads flags the page, and the client (one of --clients, each request
                from a random one) copies it to the page's R best nodes and from then on reads it
                from a random one of them. Copies made and copy rounds are counted.
For each: max/mean node load (pages read per node over all requests), max/mean pages held,
RPCs per lookup (nodes one request asks, all at once: one round for every scheme), and the
fraction of stored pages that move when one node joins and when one leaves (1/N is ideal).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a key's and node's hash combined into a uniform 64-bit value."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def rank(unit_keys: np.ndarray, node_ids: np.ndarray, replicas: int) -> np.ndarray:
    """The `replicas` highest-scoring nodes (indices into node_ids) of each unit key: -1/ln(u), equal weights."""
    out = np.empty((len(unit_keys), replicas), dtype=np.int64)
    for start in range(0, len(unit_keys), 4096):
        keys = unit_keys[start:start + 4096]
        with np.errstate(over="ignore"):
            u = (mix(keys[:, None] ^ node_ids[None, :]).astype(np.float64) + 0.5) / 2.0 ** 64
        scores = -1.0 / np.log(u)
        out[start:start + 4096] = np.argsort(-scores, axis=1)[:, :replicas]
    return out


def workload(args: argparse.Namespace, rng: np.random.Generator) -> tuple[list[np.ndarray], np.ndarray]:
    """Chains of page keys (uint64 prefix hashes) and the conversation each request reads."""
    prompts = [rng.integers(1, 2**63, rng.integers(8, 33), dtype=np.uint64) for _ in range(10)]
    prompt_p = 1.0 / np.arange(1, 11) ** 1.2
    prompt_p /= prompt_p.sum()
    chains = []
    for _ in range(args.conversations):
        own = rng.integers(1, 2**63, rng.integers(8, 65), dtype=np.uint64)
        if rng.random() < 0.8:
            chains.append(np.concatenate([prompts[rng.choice(10, p=prompt_p)], own]))
        else:
            chains.append(own)
    # A prefix hash names the whole prefix: a chain's keys are distinct from another's after they part.
    # Own pages are random already; shared prompt pages are equal across chains, as they should be.
    conv_p = 1.0 / np.arange(1, args.conversations + 1) ** 1.1
    conv_p /= conv_p.sum()
    requests = rng.choice(args.conversations, size=args.requests, p=conv_p)
    return chains, requests


def units(chains: list[np.ndarray], scheme: str) -> list[list[tuple[np.uint64, int, int]]]:
    """Each chain's placement units: (key that places it, first page, end page)."""
    result = []
    for chain in chains:
        if scheme == "page":
            result.append([(k, i, i + 1) for i, k in enumerate(chain)])
        elif scheme == "chain":
            result.append([(chain[0], 0, len(chain))])
        else:
            k = int(scheme[3:].split("+")[0])
            result.append([(chain[s], s, min(s + k, len(chain))) for s in range(0, len(chain), k)])
    return result


def place(chain_units, node_ids: np.ndarray, replicas: int) -> dict[int, np.ndarray]:
    keys = np.array(sorted({int(u[0]) for cu in chain_units for u in cu}), dtype=np.uint64)
    ranked = rank(keys, node_ids, replicas)
    return {int(k): r for k, r in zip(keys, ranked)}


def replication(scheme: str, chain_units, requests) -> tuple[int, "callable"]:
    """(most copies of a unit, copies(key, start) for each unit) of a scheme."""
    if "+hot" in scheme:
        replicas = int(scheme.split("+hot")[1])
        reads: dict[int, int] = {}
        for conversation in requests:
            for key, _, _ in chain_units[conversation]:
                reads[int(key)] = reads.get(int(key), 0) + 1
        hot = set(sorted(reads, key=reads.get, reverse=True)[:max(1, len(reads) // 100)])
        return replicas, lambda key, start: replicas if int(key) in hot else 1
    if "+r" in scheme:
        replicas_text, _, segments_text = scheme.split("+r")[1].partition("x")
        replicas, segments = int(replicas_text), int(segments_text or 1)
        k = int(scheme[3:].split("+")[0])
        return replicas, lambda key, start: replicas if start < segments * k else 1
    return 1, lambda key, start: 1


def node_ids_of(nodes: int) -> np.ndarray:
    """nodes + 1 node ids (the last one joins in the move measure)."""
    return mix(np.arange(1, nodes + 2, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))


def evaluate(scheme: str, chains, requests, nodes: int, rng: np.random.Generator) -> dict[str, float]:
    chain_units = units(chains, scheme)
    replicas, copies = replication(scheme, chain_units, requests)
    node_ids = node_ids_of(nodes)
    where = place(chain_units, node_ids[:nodes], replicas)
    held = np.zeros(nodes)
    stored = {}
    for cu in chain_units:
        for key, start, stop in cu:
            owners = where[int(key)][:copies(key, start)]
            for owner in owners:
                if (int(key), int(owner)) not in stored:
                    stored[(int(key), int(owner))] = stop - start
                    held[owner] += stop - start
    load = np.zeros(nodes)
    rpcs = 0
    for conversation in requests:
        asked = set()
        for key, start, stop in chain_units[conversation]:
            owners = where[int(key)][:copies(key, start)]
            owner = owners[rng.integers(len(owners))]
            load[owner] += stop - start
            asked.add(int(owner))
        rpcs += len(asked)
    return {"load_max_over_mean": float(load.max() / load.mean()), "held_max_over_mean": float(held.max() / held.mean()),
            "rpcs_per_lookup": rpcs / len(requests), "rounds_per_lookup": 1,
            **moves(chain_units, where, copies, node_ids, nodes, replicas), "stored_pages_with_copies": float(held.sum())}


def evaluate_popular(scheme: str, chains, requests, nodes: int, rng: np.random.Generator,
                     args: argparse.Namespace) -> dict[str, float]:
    """page+popR, request by request: node read counts, hot flags, client copies and spread reads."""
    replicas = int(scheme.split("+pop")[1])
    chain_units = units(chains, "page")
    node_ids = node_ids_of(nodes)
    where = place(chain_units, node_ids[:nodes], replicas)
    heat: dict[tuple[int, int], tuple[float, float]] = {}     # (key, node) -> (decayed count, last read)
    copied: set[tuple[int, int]] = set()                      # (key, node) copies beyond the best node
    spread = [set() for _ in range(args.clients)]             # keys each client reads from any replica
    load, held = np.zeros(nodes), np.zeros(nodes)
    for key, ranked in where.items():
        held[ranked[0]] += 1
    rpcs = copy_rounds = 0
    for t, conversation in enumerate(requests):
        now, client = t / args.rate, int(rng.integers(args.clients))
        asked, flagged = set(), []
        for key, _, _ in chain_units[conversation]:
            key = int(key)
            ranked = where[key]
            owner = int(ranked[rng.integers(len(ranked))]) if key in spread[client] else int(ranked[0])
            load[owner] += 1
            asked.add(owner)
            count, last = heat.get((key, owner), (0.0, now))
            count = count * 0.5 ** ((now - last) / args.hot_half_life) + 1.0
            heat[(key, owner)] = (count, now)
            if count + 0.5 >= args.hot_reads and key not in spread[client]:   # as read_heat.py
                flagged.append(key)
        rpcs += len(asked)
        if flagged:
            copy_rounds += 1
            for key in flagged:
                for node in where[key][1:].tolist():
                    if (key, node) not in copied:
                        copied.add((key, node))
                        held[node] += 1
                spread[client].add(key)
    hot = {key for key, _ in copied}
    result = {"load_max_over_mean": float(load.max() / load.mean()), "held_max_over_mean": float(held.max() / held.mean()),
              "rpcs_per_lookup": rpcs / len(requests), "rounds_per_lookup": 1,
              **moves(chain_units, where, lambda key, start: replicas if int(key) in hot else 1, node_ids, nodes,
                      replicas),
              "stored_pages_with_copies": float(held.sum()), "pages_copied": len(copied), "hot_pages": len(hot),
              "requests_with_a_copy_round": copy_rounds / len(requests)}
    return result


def moves(chain_units, where, copies, node_ids: np.ndarray, nodes: int, replicas: int) -> dict[str, float]:
    """Fraction of stored pages (copies counted) that move when one node joins and when one leaves."""
    moved = {}
    for change, ids in (("join", node_ids[:nodes + 1]), ("leave", node_ids[1:nodes])):
        after = place(chain_units, ids, replicas)
        before_ids, after_ids = node_ids[:nodes], ids
        pages = moved_pages = 0
        distinct = {int(key): (stop - start, copies(key, start)) for cu in chain_units for key, start, stop in cu}
        for key, (size, r) in distinct.items():     # each stored unit once, however many chains share it
            old = {int(before_ids[i]) for i in where[key][:r]}
            new = {int(after_ids[i]) for i in after[key][:r]}
            pages += size * r
            moved_pages += size * len(new - old)
        moved[change] = moved_pages / pages
    return {"moved_on_join": moved["join"], "moved_on_leave": moved["leave"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--conversations", type=int, default=3000)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--schemes", default="page,page+pop3,page+pop8,chain,seg4,seg16,seg64,seg16+r3,seg16+r8,"
                                              "seg16+r3x2,seg16+r8x2,seg16+r16x2,seg16+hot8,seg16+hot16")
    parser.add_argument("--clients", type=int, default=16, help="page+popR: clients (engines), each its own memory")
    parser.add_argument("--rate", type=float, default=100.0, help="page+popR: requests per second, all clients")
    parser.add_argument("--hot-reads", type=float, default=4, help="page+popR: cluster.hot_reads")
    parser.add_argument("--hot-half-life", type=float, default=60.0, help="page+popR: cluster.hot_half_life_s")
    parser.add_argument("--json", default="bench/results/placement_sim.json")
    args = parser.parse_args()
    chains, requests = workload(args, np.random.default_rng(args.seed))
    print(f"{args.nodes} nodes, {args.conversations} conversations ({sum(map(len, chains))} pages), "
          f"{args.requests} requests; ideal move on a join 1/{args.nodes + 1} = {1 / (args.nodes + 1):.4f}, "
          f"on a leave 1/{args.nodes} = {1 / args.nodes:.4f}")
    print(f"{'scheme':<10} {'load max/mean':>13} {'held max/mean':>13} {'RPCs/lookup':>11} {'rounds':>6} "
          f"{'moved join':>10} {'moved leave':>11}")
    results = {}
    for scheme in args.schemes.split(","):
        started = time.perf_counter()
        rng = np.random.default_rng(args.seed)
        r = (evaluate_popular(scheme, chains, requests, args.nodes, rng, args) if "+pop" in scheme
             else evaluate(scheme, chains, requests, args.nodes, rng))
        results[scheme] = r
        print(f"{scheme:<10} {r['load_max_over_mean']:>13.2f} {r['held_max_over_mean']:>13.2f} "
              f"{r['rpcs_per_lookup']:>11.2f} {r['rounds_per_lookup']:>6} {r['moved_on_join']:>10.4f} "
              f"{r['moved_on_leave']:>11.4f}   ({time.perf_counter() - started:.1f}s)")
        if "+pop" in scheme:
            print(f"{'':<10} {r['hot_pages']} pages hot, {r['pages_copied']} copies made "
                  f"({r['pages_copied'] / (r['stored_pages_with_copies'] - r['pages_copied']):.1%} more pages held), "
                  f"{r['requests_with_a_copy_round']:.1%} of requests wrote copies (one more round, once per client)")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
