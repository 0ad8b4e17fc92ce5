"""Where an adapter finds its kvstore-server: settings read from the engine's own config.

Engines hand their plug-ins a flat mapping (SGLang's extra-config JSON, LMCache's
extra_config); our keys in it share one prefix, and a key with that prefix that we do not
know stops start-up naming it, as kvstore's own config does.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Mapping

from kvstore_client.arguments import is_cluster_url
from kvstore_client.client import KVStoreClient


@dataclasses.dataclass(frozen=True)
class AdapterSettings:
    target: str                 # a node's gRPC address ("127.0.0.1:50051") or a cluster ("etcd://h:2379/prod")
    timeout_s: float = 5.0      # deadline of every call
    control: str = "local"      # "local" (Unix socket, same host) or "grpc"
    tenant: str = ""            # keeps one tenant's pages apart from another's
    salt: str = ""              # a deployment's salt (the namespace's hash_seed): shares no page with other salts
    # The engine's prefill cost a token here (seconds): a hit is answered only as far as loading it is faster than
    # prefilling it (fetch or recompute, load_estimate.py); 0 answers every hit.
    recompute_s_per_token: float = 0.0

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None, prefix: str, where: str) -> "AdapterSettings":
        values = {k[len(prefix):]: v for k, v in (mapping or {}).items() if k.startswith(prefix)}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{where}: unknown setting(s) {', '.join(prefix + u for u in unknown)}; "
                             f"known: {', '.join(prefix + k for k in sorted(known))}")
        target = values.get("target")
        if not isinstance(target, str) or not target:
            raise ValueError(f"{where}: {prefix}target is required: a kvstore-server's gRPC address, "
                             "e.g. \"127.0.0.1:50051\", or a cluster's, e.g. \"etcd://10.0.0.1:2379/prod\"")
        timeout_s = values.get("timeout_s", cls.timeout_s)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"{where}: {prefix}timeout_s must be a positive number of seconds, got {timeout_s!r}")
        control = values.get("control", cls.control)
        if control not in ("local", "grpc"):
            raise ValueError(f"{where}: {prefix}control must be \"local\" or \"grpc\", got {control!r}")
        tenant = values.get("tenant", cls.tenant)
        if not isinstance(tenant, str):
            raise ValueError(f"{where}: {prefix}tenant must be a string, got {tenant!r}")
        salt = values.get("salt", cls.salt)
        if not isinstance(salt, str):
            raise ValueError(f"{where}: {prefix}salt must be a string, got {salt!r}")
        recompute = values.get("recompute_s_per_token", cls.recompute_s_per_token)
        if isinstance(recompute, bool) or not isinstance(recompute, (int, float)) or not 0 <= recompute < 1:
            raise ValueError(f"{where}: {prefix}recompute_s_per_token must be seconds a token, 0 to 1 (0: off), "
                             f"got {recompute!r}")
        return cls(target=target, timeout_s=float(timeout_s), control=control, tenant=tenant, salt=salt,
                   recompute_s_per_token=float(recompute))


class ClientPerThread:
    """One KVStoreClient per calling thread: engines call their storage backends from several
    I/O threads at once, and a client's control channel pipelines one caller's requests."""

    def __init__(self, settings: AdapterSettings, client_name: str):
        self._settings = settings
        self._client_name = client_name
        self._local = threading.local()
        self._clients: list[KVStoreClient] = []
        self._buffers: list[tuple[int, int, Any]] = []   # the engine's host pools, registered on every client
        self._lock = threading.Lock()
        self.get()  # connect now, so a wrong target fails at start-up, not on the first request

    def get(self) -> KVStoreClient:
        client = getattr(self._local, "client", None)
        if client is None and is_cluster_url(self._settings.target):
            with self._lock:   # a cluster's client is shared: it fans each call out over its own threads
                client = self._clients[0] if self._clients else None
        if client is None:
            s = self._settings
            client = KVStoreClient(s.target, timeout_s=s.timeout_s, control=s.control, client_name=self._client_name)
            self._local.client = client
            with self._lock:
                self._clients.append(client)
                buffers = list(self._buffers)
            for address, nbytes, owner in buffers:
                client.register_buffer(address, nbytes, owner)
        return client

    def register_buffer(self, address: int, nbytes: int, owner: Any) -> None:
        """Register an engine's host KV pool with every client, present and future (RDMA moves pages
        inside it without registering them per call; other data planes ignore it)."""
        with self._lock:
            self._buffers.append((address, nbytes, owner))
            clients = list(self._clients)
        for client in clients:
            client.register_buffer(address, nbytes, owner)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()
