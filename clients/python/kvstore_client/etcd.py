"""A blocking face on aetcd, the asyncio etcd v3 client: one event loop thread per session.

Why aetcd: it is maintained, speaks etcd's v3 gRPC API (leases, transactions, watches)
and runs on the grpcio and protobuf this project already uses (python-etcd3 pins a
protobuf three major versions old; etcd3gw goes through the JSON gateway and cannot
stream a watch as cheaply). kvstore's callers are threads, so the loop lives in its own
daemon thread and every call is handed to it with a deadline.

aetcd talks to one endpoint at a time; a session tries the configured endpoints in
order and moves to the next when one fails.

TLS: an `https://` endpoint, or any endpoint of a session given EtcdTlsFiles, is dialled over
TLS (the server checked against the CA, this side's certificate presented for etcd's
--client-cert-auth); `http://` is plaintext, and refused with TLS files, which would not be
used. aetcd itself dials every endpoint with grpc.aio.insecure_channel; `_dial` takes that one
function's place and dials over TLS when the session connecting now says so (a context
variable set around its own connect), so sessions of one process never share TLS settings.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any, Awaitable, Callable, Sequence, TypeVar
from urllib.parse import urlsplit

from kvstore_client.credentials import EtcdTlsFiles
from kvstore_client.errors import InvalidArgument

T = TypeVar("T")

_DIAL_TLS: contextvars.ContextVar[Any] = contextvars.ContextVar("kvstore_etcd_tls", default=None)


def _dial(target: str, options: Any = None, *args: Any, **kwargs: Any) -> Any:
    """aetcd's channel: over TLS with the credentials of the session connecting now, else plaintext."""
    import grpc.aio
    credentials = _DIAL_TLS.get()
    if credentials is None:
        return grpc.aio.insecure_channel(target, options, *args, **kwargs)
    return grpc.aio.secure_channel(target, credentials, options, *args, **kwargs)


class EtcdUnavailable(Exception):
    """No configured etcd endpoint answered within the deadline; the message names them."""


def parse_endpoint(text: str) -> tuple[str, int, str]:
    """'https://10.0.0.1:2379', 'http://10.0.0.1:2379', '10.0.0.1:2379' or '10.0.0.1' -> (host, port, scheme),
    scheme "" when none is written."""
    shape = f"etcd endpoint {text!r} must look like host:port, http://host:port or https://host:port"
    try:
        parts = urlsplit(text if "://" in text else f"//{text}")
        port = parts.port   # parsed on first read: a port that is no number, or past 65535, raises here
    except ValueError as exc:
        raise InvalidArgument(f"{shape} ({exc})") from None
    if not parts.hostname or parts.scheme not in ("", "http", "https"):
        raise InvalidArgument(shape)
    return parts.hostname, port or 2379, parts.scheme


class EtcdSession:
    def __init__(self, endpoints: Sequence[str], timeout_s: float, tls: EtcdTlsFiles | None = None):
        try:
            import aetcd  # imported here: only clustered nodes and cluster clients need it
            import aetcd.rpc
        except ImportError as exc:
            raise ImportError(f"etcd needs its client, aetcd ({exc}): pip install 'kvstore-client[cluster]'") from None

        if not endpoints:
            raise InvalidArgument("no etcd endpoint given")
        self._aetcd = aetcd
        parsed = [parse_endpoint(e) for e in endpoints]
        plain = [f"{h}:{p}" for h, p, scheme in parsed if scheme == "http"]
        if plain and (tls is not None or any(scheme == "https" for _, _, scheme in parsed)):
            raise InvalidArgument(f"etcd endpoint(s) {', '.join(plain)} are http:// where others are https:// or TLS "
                                  "files are given: write https:// (or leave the scheme out)")
        secure = any(scheme == "https" for _, _, scheme in parsed) or tls is not None
        self._tls = (tls or EtcdTlsFiles()).credentials() if secure else None   # every endpoint, or none
        aetcd.rpc.insecure_channel = _dial
        self.endpoints = [(h, p) for h, p, _ in parsed]
        self.timeout_s = timeout_s
        self._current = 0
        self._client: Any = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="etcd-loop", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        host, port = self.endpoints[self._current]
        return f"{host}:{port}"

    def describe(self) -> str:
        return ", ".join(f"{h}:{p}" for h, p in self.endpoints)

    def call(self, action: Callable[[Any], Awaitable[T]], timeout_s: float | None = None) -> T:
        """Run `action(aetcd_client)` on the loop; EtcdUnavailable if no endpoint answers in time."""
        future = asyncio.run_coroutine_threadsafe(self.run(action, timeout_s), self._loop)
        return future.result()

    def submit(self, coroutine: Awaitable[Any]) -> "asyncio.Future[Any]":
        """Start a long-running coroutine (a watch) on the loop."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)  # type: ignore[arg-type]

    async def run(self, action: Callable[[Any], Awaitable[T]], timeout_s: float | None = None) -> T:
        """On the loop: try each endpoint once, starting from the one that last worked."""
        timeout_s = timeout_s or self.timeout_s
        problems = []
        for attempt in range(len(self.endpoints)):
            try:
                client = await self._connected()
                return await asyncio.wait_for(action(client), timeout_s)
            except (self._aetcd.ClientError, asyncio.TimeoutError, OSError) as exc:
                if isinstance(exc, self._aetcd.PreconditionFailedError):
                    raise
                problems.append(f"{self.endpoint}: {type(exc).__name__} {exc}".strip())
                await self._drop()
                self._current = (self._current + 1) % len(self.endpoints)
        raise EtcdUnavailable(f"etcd unreachable at {self.describe()} ({'; '.join(problems)})")

    async def run_watch(self, watch: Callable[[Any, int], Awaitable[None]], start_revision: int) -> None:
        """On the loop: follow a watch on the endpoint that last answered, until it ends or fails."""
        await watch(await self._connected(), start_revision)

    async def _connected(self) -> Any:
        if self._client is None:
            host, port = self.endpoints[self._current]
            client = self._aetcd.Client(host=host, port=port, timeout=max(1, round(self.timeout_s)))
            dialling = _DIAL_TLS.set(self._tls)
            try:
                await client.connect()
            finally:
                _DIAL_TLS.reset(dialling)
            self._client = client
        return self._client

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.close()
            except Exception:  # a broken channel may fail to close; it is dropped either way
                pass

    def close(self) -> None:
        if not self._loop.is_running():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._drop(), self._loop).result(self.timeout_s)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.timeout_s)
