"""Prefill-to-decode handoff through a kvstore cluster: a prefill process writes each chunk's KV
pages as soon as it computes them, a decode process loads them as they are committed.

    python examples/pd_handoff.py [--tokens 8192] [--runs overlap,after] [--json out.json]

It starts a real etcd and `--nodes` kvstore nodes registered in it (temp dirs, free ports),
then, for each prompt length and each mode, two processes:
  prefill  builds the model, prefills the prompt in chunks of `--chunk-tokens` (each chunk
           attends to the cache so far, as chunked prefill does) and after each chunk puts its
           full pages into the cluster (KVStoreClient(etcd://...).put of each chunk after its parent). It sends the
           first answer token and the time its last page was committed.
  decode   knows the prompt's tokens, so its keys. `overlap`: it asks for every page at once
           with get(wait_ms=...) as prefill starts; each node answers its pages as soon as it
           is complete. `after`: it asks only once prefill says it is done (transfer after
           prefill). It then runs one decode step on the loaded cache, then prefills the
           prompt itself the same way and checks that both decode steps' logits are identical.
Reported per run: the time from prefill's last page to decode holding all pages (both
processes read the same clock), prefill time, and the pages and bytes moved. The decode
process reaches the nodes over TCP (`--decode-transport`), as a decode engine on another
host would; the prefill one over shared memory. The model is a small Llama with random
weights (nothing downloaded); KV pages are float32. Exits 1 if the logits differ.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_etcd(workdir: str) -> tuple[subprocess.Popen, str]:
    """A one-member etcd on loopback, answering; returns its process and client URL."""
    if shutil.which("etcd") is None:
        raise SystemExit("etcd is not installed (apt-get install etcd-server)")
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    etcd = subprocess.Popen(["etcd", "--name", "pd", "--data-dir", os.path.join(workdir, "etcd"),
                             "--listen-client-urls", client, "--advertise-client-urls", client,
                             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                             "--initial-cluster", f"pd={peer}", "--log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            with urllib.request.urlopen(f"{client}/health", timeout=1):
                break
        except OSError:
            time.sleep(0.1)
    return etcd, client


def start_cluster(workdir: str, nodes: int, arena: str) -> tuple[list[subprocess.Popen], str]:
    """A one-member etcd and `nodes` kvstore nodes in cluster "pd"; returns the processes and the cluster URL."""
    etcd, client = start_etcd(workdir)
    procs = [etcd]
    for i in range(nodes):
        ready = os.path.join(workdir, f"ready{i}.json")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvstore.server", "--grpc-address", "127.0.0.1:0", "--ready-file", ready,
             "--shm-socket", os.path.join(workdir, f"node{i}.sock"), "--arena-bytes", arena,
             "--set", "nvme.enabled=false", "--set", "server.log_level=WARNING",
             "--set", "ops.metrics_address=127.0.0.1:0", "--set", f"cluster.endpoints={client}",
             "--set", "cluster.name=pd", "--set", f"cluster.node_id=node{i}", "--set", "cluster.ramp_s=0"]))
        while not os.path.exists(ready):
            if procs[-1].poll() is not None:
                raise SystemExit("a kvstore node failed to start")
            time.sleep(0.05)
    return procs, f"etcd://{client.removeprefix('http://')}/pd"


def build_model(args: argparse.Namespace):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=1, max_position_embeddings=max(args.tokens_list) + 64)
    return LlamaForCausalLM(config).eval()


def prompt_tokens(args: argparse.Namespace, tokens: int) -> list[int]:
    import torch

    return torch.randint(0, args.vocab, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()


def chunked_prefill(model, tokens: list[int], chunk_tokens: int, on_chunk=None):
    """The prompt's cache and last logits, prefilled chunk by chunk; on_chunk(cache, end) after each."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        for start in range(0, len(tokens), chunk_tokens):
            end = min(start + chunk_tokens, len(tokens))
            out = model(torch.tensor([tokens[start:end]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            if on_chunk is not None:
                on_chunk(cache, end)
    return cache, out.logits[0, -1]


def pack(cache, start_page: int, stop_page: int, page_tokens: int):
    """Pages [start, stop) of the cache, laid out as kvstore_client.adapters.transformers does."""
    import torch

    a, b = start_page * page_tokens, stop_page * page_tokens
    kv = torch.stack([torch.stack((layer.keys[0, :, a:b], layer.values[0, :, a:b])) for layer in cache.layers])
    layers, _, heads, _, dim = kv.shape
    pages = kv.reshape(layers, 2, heads, stop_page - start_page, page_tokens, dim).permute(3, 0, 1, 2, 4, 5)
    return pages.contiguous().reshape(stop_page - start_page, -1).view(torch.uint8)


def unpack(pages, ns):
    import torch
    from transformers import DynamicCache

    count = pages.shape[0]
    kv = pages.view(torch.float32).reshape(count, ns.num_layers, 2, ns.num_kv_heads, ns.page_tokens, ns.head_dim)
    kv = kv.permute(1, 2, 3, 0, 4, 5).reshape(ns.num_layers, 2, ns.num_kv_heads, -1, ns.head_dim)
    return DynamicCache(ddp_cache_data=[(kv[i, 0].unsqueeze(0).contiguous(), kv[i, 1].unsqueeze(0).contiguous())
                                        for i in range(ns.num_layers)])


def prefill_process(args, url: str, tokens: int, go, prefill_done, results) -> None:
    import torch
    from kvstore_client.adapters.transformers import namespace_for
    from kvstore_client import KVStoreClient
    from kvstore_client.keys import prefix_hashes

    torch.set_num_threads(1)
    model = build_model(args)
    ns = namespace_for(model.config, f"pd-{tokens}", page_tokens=args.page_tokens)
    prompt = prompt_tokens(args, tokens)
    keys = prefix_hashes(prompt, args.page_tokens)
    stored = [0]
    with KVStoreClient(url) as cluster:
        def put_chunk(cache, end: int) -> None:
            full = end // args.page_tokens
            if full > stored[0]:
                parent = keys[stored[0] - 1] if stored[0] else None
                assert cluster.put(ns, keys[stored[0]:full], pack(cache, stored[0], full, args.page_tokens),
                                   parent=parent) == full - stored[0]
                stored[0] = full

        go.wait()
        started = time.time()
        _, logits = chunked_prefill(model, prompt, args.chunk_tokens, put_chunk)
        last_page_at = time.time()
        prefill_done.set()            # what tells an `after` decode to start loading
        results.put({"role": "prefill", "last_page_at": last_page_at, "prefill_s": time.time() - started,
                     "first_token": int(logits.argmax()), "pages": stored[0], "page_bytes": ns.page_bytes})


def decode_process(args, url: str, tokens: int, mode: str, go, prefill_done, results) -> None:
    import torch
    from kvstore_client.adapters.transformers import namespace_for
    from kvstore_client import KVStoreClient
    from kvstore_client.keys import prefix_hashes

    torch.set_num_threads(1)
    model = build_model(args)
    ns = namespace_for(model.config, f"pd-{tokens}", page_tokens=args.page_tokens)
    prompt = prompt_tokens(args, tokens)
    keys = prefix_hashes(prompt, args.page_tokens)
    pages = torch.empty((len(keys), ns.page_bytes), dtype=torch.uint8)
    with KVStoreClient(url, transport=args.decode_transport, timeout_s=5) as cluster:
        go.wait()
        if mode == "after":
            prefill_done.wait()
        loaded = 0
        while loaded < len(keys):         # wait_ms is bounded by the node: ask again for the rest
            loaded += cluster.get(ns, keys[loaded:], pages[loaded:], wait_ms=args.wait_ms)
        holding_at = time.time()
    prefill = results_get(results, "prefill")
    cache = unpack(pages, ns)
    first = prefill["first_token"]
    with torch.no_grad():
        remote = model(torch.tensor([[first]]), past_key_values=cache, use_cache=True).logits[0, -1]
        local_cache, local_logits = chunked_prefill(model, prompt, args.chunk_tokens)
        local = model(torch.tensor([[first]]), past_key_values=local_cache, use_cache=True).logits[0, -1]
    results.put({"role": "decode", "holding_at": holding_at, "pages": len(keys),
                 "first_token_matches": int(local_logits.argmax()) == first,
                 "logits_identical": bool(torch.equal(remote, local)),
                 "logits_max_abs_diff": float((remote - local).abs().max()), "prefill": prefill})


def results_get(queue, role: str) -> dict:
    """The prefill's report, put back for the parent (decode reads it to learn the first token)."""
    item = queue.get(timeout=600)
    assert item["role"] == role
    queue.put(item)
    return item


def run_once(args, url: str, tokens: int, mode: str) -> dict:
    ctx = mp.get_context("spawn")
    go, prefill_done, results = ctx.Event(), ctx.Event(), ctx.Queue()
    decode = ctx.Process(target=decode_process, args=(args, url, tokens, mode, go, prefill_done, results))
    prefill = ctx.Process(target=prefill_process, args=(args, url, tokens, go, prefill_done, results))
    decode.start()
    prefill.start()
    time.sleep(args.warmup_s)      # both have built their model and joined the cluster
    go.set()
    prefill.join()
    decode.join()
    report = [results.get(timeout=60) for _ in range(2)]
    decoded = next(r for r in report if r["role"] == "decode")
    p = decoded["prefill"]
    return {"tokens": tokens, "mode": mode, "prefill_s": p["prefill_s"], "pages": p["pages"],
            "bytes": p["pages"] * p["page_bytes"],
            "last_page_to_decode_holding_s": decoded["holding_at"] - p["last_page_at"],
            "logits_identical": decoded["logits_identical"], "first_token_matches": decoded["first_token_matches"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="8192", help="prompt lengths, comma separated")
    parser.add_argument("--runs", default="overlap,after")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--arena", default="512MiB")
    parser.add_argument("--page-tokens", type=int, default=64)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--wait-ms", type=int, default=5000)
    parser.add_argument("--decode-transport", default="tcp", choices=("tcp", "auto"))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--warmup-s", type=float, default=8.0)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    args.tokens_list = [int(t) for t in args.tokens.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvstore-pd-") as workdir:
        procs, url = start_cluster(workdir, args.nodes, args.arena)
        try:
            for tokens in args.tokens_list:
                for mode in args.runs.split(","):
                    row = run_once(args, url, tokens, mode)
                    rows.append(row)
                    print(f"{tokens:>6} tokens  {mode:<8} prefill {row['prefill_s']:7.2f}s  pages {row['pages']:>4} "
                          f"({row['bytes'] / 2**20:6.1f} MiB)  last page -> decode holds all: "
                          f"{row['last_page_to_decode_holding_s'] * 1000:8.1f} ms  logits identical: "
                          f"{row['logits_identical']}", flush=True)
        finally:
            for proc in reversed(procs):
                proc.terminate()
                proc.wait(30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "runs": rows}, f, indent=2)
    return 0 if all(r["logits_identical"] and r["first_token_matches"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
