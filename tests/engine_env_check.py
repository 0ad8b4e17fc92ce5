"""Run inside an engine's venv (tests/engine_envs.py): the SDK next to the engine's own dependency set.

    python engine_env_check.py --engine sglang --adapter kvstore_client.adapters.sglang --address HOST:PORT

Prints one JSON object: how far the engine's top-level package imports on this CPU-only machine, where
the SDK was imported from, the versions it runs with, the wire contract's messages (wire_contract_check),
and the checks of pages put to the node and got back: numpy pages over both control channels, and a
torch page, as the engines hand them over. The SDK and its adapter must import, without a warning.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import types
from importlib.metadata import version

import wire_contract_check

PAGE_TOKENS = 16


def import_engine(engine: str) -> dict:
    """Import the engine's top-level package; where that stops on a CPU, leave a bare one in its place."""
    try:
        importlib.import_module(engine)
    except Exception as exc:   # what stops it on a CPU is the finding, not a failure of this check
        bare_package(engine)
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    return {"ok": True}


def bare_package(engine: str) -> None:
    """The engine as a package whose submodules load from its wheel without its __init__ (as
    integration/sglang_harness.py does for SGLang, whose __init__ imports triton)."""
    for name in [n for n in sys.modules if n == engine or n.startswith(engine + ".")]:
        del sys.modules[name]   # what the failed import left half-built
    spec = importlib.util.find_spec(engine)
    package = types.ModuleType(engine)
    package.__path__, package.__spec__, package.__file__ = list(spec.submodule_search_locations), spec, spec.origin
    sys.modules[engine] = package


def torch_page_round_trip(address: str) -> dict:
    import torch

    from kvstore_client import KVStoreClient, Namespace, prefix_hashes

    pages = torch.randn((2, 16 * 1024), generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = torch.zeros_like(pages)
    namespace = Namespace(model="engine-check-torch", page_bytes=pages[0].numel() * pages.element_size(),
                          page_tokens=PAGE_TOKENS, kv_dtype="bfloat16")
    keys = prefix_hashes(list(range(2 * PAGE_TOKENS)), PAGE_TOKENS)
    with KVStoreClient(address, timeout_s=10) as client:
        put, got = int(client.put(namespace, keys, pages)), int(client.get(namespace, keys, out, verify=True))
    return {"put": put, "got": got, "same_bytes": out.view(torch.uint8).numpy().tobytes()
            == pages.view(torch.uint8).numpy().tobytes()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", required=True)
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--address", required=True)
    args = parser.parse_args()
    wire_contract_check.import_contract()   # first, so that a warning it raises is not hidden by an earlier import
    engine = {"version": version(args.engine), "import": import_engine(args.engine)}
    importlib.import_module(args.adapter)
    import kvstore_client
    import torch
    import xxhash

    versions = {**wire_contract_check.versions(), "torch": torch.__version__, "xxhash": xxhash.VERSION}
    print(json.dumps({"engine": engine, "kvstore_client": kvstore_client.__file__, "versions": versions,
                      "messages": wire_contract_check.message_bytes(),
                      "pages": wire_contract_check.page_round_trips(args.address, "float16"),
                      "torch_page": torch_page_round_trip(args.address)}))


if __name__ == "__main__":
    main()
