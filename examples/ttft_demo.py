"""End to end: time to first token of a multi-turn chat, recomputing every prompt vs loading its prefix from kvstore.

    python examples/ttft_demo.py [--clients 4 --rounds 4 --plot ttft_demo.png]

A small Llama-architecture model is built from a LlamaConfig with random weights (nothing
is downloaded). The workload is shaped like SGLang's benchmark/hicache/bench_multiturn.py:
several clients, several rounds, each round's prompt is the client's whole conversation so
far plus a new question; here the first round also carries a long document (as a RAG or
agent chat does), so later rounds are mostly history. Answers are greedy.

The same workload runs three times on the same model:
  recompute  every round prefills the whole prompt (an engine with no cache);
  kvstore    every round loads the prompt's cached prefix pages from a kvstore node,
             prefills only the new tokens, and after answering stores the conversation's
             pages (the store is not part of the time to first token, as with write-through);
  fetch or recompute
             as kvstore, but each round first asks the node where the prefix is and what
             loading it costs (client.residency) and loads only the pages that load faster
             than this model prefills them (its prefill cost a token, measured on the
             recompute run's rounds so far).
`--slow-tier-ms N` makes the node's tier slow: every page an Acquire answers costs N ms more
(the test-only failpoint acquire.each_page), a stand-in for a throttled device. Loading then
loses to recomputing, and fetch or recompute recomputes.
It prints TTFT per round for each run, the hit rates, and the largest difference between the
runs' logits, checks that every answer is identical, and writes a PNG plot. Exits 1 if an
answer or the logits differ.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights: nothing to fetch

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvstore_client import KVStoreClient  # noqa: E402
from kvstore_client.adapters.transformers import TransformersKVPages, namespace_for  # noqa: E402
from quickstart import start_node  # noqa: E402  (same directory)

LOGITS_ATOL = 1e-3   # float32 prefill in one piece vs in two: rounding differences only


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=8192)
    return LlamaForCausalLM(config).eval()


def make_workload(args: argparse.Namespace) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    return [{"document": torch.randint(0, args.vocab, (args.context_tokens,), generator=gen).tolist(),
             "questions": [torch.randint(0, args.vocab, (args.question_tokens,), generator=gen).tolist()
                           for _ in range(args.rounds)]}
            for _ in range(args.clients)]


@torch.no_grad()
def answer(model, prompt: list[int], pages: TransformersKVPages | None, answer_tokens: int,
           recompute_s_per_token: float = 0.0) -> dict:
    """Time to first token, then greedy decoding; with `pages`, reuse and then store the cached prefix (only what
    loads faster than it prefills, given `recompute_s_per_token`)."""
    started = time.perf_counter()
    cache, cached = None, 0
    if pages is not None:
        # At least one prompt token is prefilled: its logits give the first answer token.
        cache, cached = pages.load(prompt, pages_max=(len(prompt) - 1) // pages.namespace.page_tokens,
                                   recompute_s_per_token=recompute_s_per_token)
    cache = cache if cache is not None else DynamicCache(config=model.config)
    out = model(torch.tensor([prompt[cached:]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    logits = [out.logits[0, -1]]
    token = int(logits[-1].argmax())
    ttft = time.perf_counter() - started
    tokens = [token]
    for _ in range(answer_tokens - 1):
        out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1])
        token = int(logits[-1].argmax())
        tokens.append(token)
    store_s = 0.0
    if pages is not None:
        started = time.perf_counter()
        pages.store(cache, prompt + tokens, skip_pages=cached // pages.namespace.page_tokens)
        store_s = time.perf_counter() - started
    return {"ttft": ttft, "cached": cached, "prompt": len(prompt), "answer": tokens,
            "logits": torch.stack(logits), "store_s": store_s}


RUNS = ("recompute", "kvstore", "fetch or recompute")


def run_all(model, workload: list[dict], rounds: int, answer_tokens: int, pages: dict[str, TransformersKVPages],
            bar: tqdm) -> dict[str, list[list[dict]]]:
    """results[run][round][client]. Clients take turns each round, as concurrent chats arrive; each request is
    served by every run back to back (each with its own history and its own namespace), so the runs see the
    same machine load even when other work shares the cores."""
    histories = {name: [c["document"] for c in workload] for name in RUNS}
    results: dict[str, list[list[dict]]] = {name: [] for name in RUNS}
    prefill_s, prefill_tokens = 0.0, 0   # the recompute run's prefills so far: this model's cost a token here
    for round_index in range(rounds):
        for name in RUNS:
            results[name].append([])
        for client_index, client in enumerate(workload):
            for name in RUNS:
                prompt = histories[name][client_index] + client["questions"][round_index]
                per_token = prefill_s / prefill_tokens if prefill_tokens else 0.0
                result = answer(model, prompt, pages.get(name), answer_tokens,
                                per_token if name == "fetch or recompute" else 0.0)
                if name == "recompute":
                    prefill_s, prefill_tokens = prefill_s + result["ttft"], prefill_tokens + len(prompt)
                histories[name][client_index] = prompt + result["answer"]
                results[name][-1].append(result)
                bar.update(1)
    return results


def _median_ms(row: list[dict]) -> float:
    return statistics.median(r["ttft"] for r in row) * 1e3


def _hit(row: list[dict]) -> float:
    return sum(r["cached"] for r in row) / sum(r["prompt"] for r in row)


def report(results: dict[str, list[list[dict]]]) -> tuple[bool, list[float]]:
    out = sys.stdout
    recompute, cached, chosen = (results[name] for name in RUNS)
    out.write("\nTTFT: median over the clients of a round; store: writing the conversation's new pages after the answer; "
              "f|r: fetch or recompute\n")
    out.write(f"{'round':>5} {'prompt tok':>10} {'recompute ms':>12} {'kvstore ms':>10} {'reduction':>9} "
              f"{'hit rate':>8} {'store ms':>8} {'f|r ms':>8} {'f|r vs rc':>9} {'f|r hit':>7}\n")
    reductions, logit_diff, same = [], 0.0, True
    for round_index, (rc_row, kv_row, fr_row) in enumerate(zip(recompute, cached, chosen)):
        rc_ms, kv_ms, fr_ms = _median_ms(rc_row), _median_ms(kv_row), _median_ms(fr_row)
        store_ms = statistics.mean(r["store_s"] for r in kv_row) * 1e3
        reduction = 1 - kv_ms / rc_ms
        reductions.append(reduction)
        prompt = statistics.mean(r["prompt"] for r in kv_row)
        out.write(f"{round_index + 1:>5} {prompt:>10.0f} {rc_ms:>12.1f} {kv_ms:>10.1f} {reduction:>8.0%} "
                  f"{_hit(kv_row):>8.0%} {store_ms:>8.1f} {fr_ms:>8.1f} {fr_ms / rc_ms - 1:>+8.0%} "
                  f"{_hit(fr_row):>7.0%}\n")
        for rc, kv, fr in zip(rc_row, kv_row, fr_row):
            same &= rc["answer"] == kv["answer"] == fr["answer"]
            logit_diff = max(logit_diff, float((rc["logits"] - kv["logits"]).abs().max()),
                             float((rc["logits"] - fr["logits"]).abs().max()))
    total_hit = _hit([r for row in cached for r in row])
    later = reductions[1:] or reductions
    rc_later = [_median_ms(row) for row in recompute[1:] or recompute]
    fr_later = [_median_ms(row) for row in chosen[1:] or chosen]
    out.write(f"\nTTFT reduction, rounds 2+: mean {statistics.mean(later):.0%}, min {min(later):.0%}"
              f"   kvstore hit rate: {total_hit:.0%} of prompt tokens\n"
              f"fetch or recompute, rounds 2+: TTFT {statistics.mean(fr_later) / statistics.mean(rc_later) - 1:+.0%} "
              f"against recompute, {_hit([r for row in chosen[1:] for r in row]) if len(chosen) > 1 else 0:.0%} of "
              f"prompt tokens loaded\n"
              f"largest |logit difference| between the runs: {logit_diff:.2e} (tolerance {LOGITS_ATOL:g})\n"
              f"answers identical in every run: {'yes' if same else 'NO'}\n")
    return same and logit_diff <= LOGITS_ATOL, reductions


def plot(path: str, results: dict[str, list[list[dict]]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = range(1, len(results["recompute"]) + 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rows in results.items():
        ax.plot(rounds, [_median_ms(row) for row in rows], marker="o", label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("time to first token, median of clients (ms)")
    ax.set_xticks(list(rounds))
    ax.set_title("Multi-turn chat: TTFT per round")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    sys.stdout.write(f"plot written to {path}\n")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--context-tokens", type=int, default=2048, help="document in the first round's prompt")
    parser.add_argument("--question-tokens", type=int, default=32, help="new tokens each round")
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument("--page-tokens", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; one keeps both runs comparable when other work shares the cores")
    parser.add_argument("--slow-tier-ms", type=float, default=0.0,
                        help="make every page the node serves cost this many ms more (a slow tier's stand-in)")
    parser.add_argument("--plot", default="ttft_demo.png")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args)
    workload = make_workload(args)
    with torch.no_grad():  # one untimed prefill, so allocator warm-up is in neither run
        model(torch.tensor([workload[0]["document"]]), logits_to_keep=1)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    sys.stdout.write(f"model    Llama, {args.layers} layers, hidden {args.hidden}, {params:.0f}M random parameters, "
                     f"float32\nworkload {args.clients} clients x {args.rounds} rounds: {args.context_tokens}-token "
                     f"document, {args.question_tokens}-token questions, {args.answer_tokens}-token answers\n")
    if args.slow_tier_ms:
        sys.stdout.write(f"slow tier: every page the node serves costs {args.slow_tier_ms:g} ms more "
                         "(failpoint acquire.each_page)\n")
    settings = [f"testing.failpoints=acquire.each_page=sleep:{args.slow_tier_ms:g}"] if args.slow_tier_ms else []
    with tempfile.TemporaryDirectory(prefix="kvstore-ttft-") as workdir:
        node, address = start_node(workdir, *settings)
        try:
            with KVStoreClient(address) as client, \
                    tqdm(total=len(RUNS) * args.clients * args.rounds, desc="requests (every run)", unit="req") as bar:
                pages = {name: TransformersKVPages(client, namespace_for(model.config, f"ttft-demo-llama-{i}",
                                                                        args.page_tokens))
                         for i, name in enumerate(RUNS[1:])}
                results = run_all(model, workload, args.rounds, args.answer_tokens, pages, bar)
        finally:
            node.send_signal(signal.SIGTERM)
            node.wait(30)
    ok, _ = report(results)
    plot(args.plot, results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
