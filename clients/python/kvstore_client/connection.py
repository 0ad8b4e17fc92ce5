"""One connection to a node: what one Hello set up, replaced as a whole when the node is lost.

It holds a gRPC channel, the node's Hello (instance id, limits, offered data planes), the
control channel calls go over (the local channel beside shared memory, a call connection of the
TCP data plane beside TCP, or gRPC), the data path pages move over,
and the ids of the namespaces opened on it. The client (client.py) opens a new connection
when this one is found lost and retires this one: calls still running on it finish or fail
on it, and it is closed when the last of them leaves, so an arena is never unmapped under a
copy. A new gRPC channel each time means no reconnect backoff left over from the outage
delays the first call to a node that is back.
"""

from __future__ import annotations

import dataclasses
import logging
import ssl
import threading
from typing import Any, Callable, TypeVar

from kvstore_client import errors, node_calls
from kvstore_client.arguments import SPIN_US_DEFAULT
from kvstore_client.channel import GrpcChannel, LocalChannel
from kvstore_client.credentials import Credentials
from kvstore_client.data_path import DataPath
from kvstore_client.keys import Namespace
from kvstore_client.load_estimate import TransferRate
from kvstore_client.node_steps import Steps, drive, take_on
from kvstore_client.proto import pb
from kvstore_client.rdma_transport import RdmaOptions
from kvstore_client.shm_transport import ShmDataPath
from kvstore_client.tcp_control import TcpControlChannel
from kvstore_client.tcp_transport import TcpDataPath
from kvstore_client.transport_choice import candidates

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ConnectOptions:
    """What a client asked for; every connection it opens is opened with these."""

    target: str                 # the node's gRPC address
    timeout_s: float            # deadline of every call, and of each step of opening a connection
    control: str                # "local" (the node's own in-order channel: its Unix socket beside shm, a TCP
                                # call connection beside TCP, where Hello offers one) or "grpc"
    transport: str              # "auto", "shm", "rdma" or "tcp" (transport_choice.py)
    client_name: str = ""
    tcp_congestion: str = ""
    rdma: RdmaOptions = RdmaOptions()
    credentials: Credentials = Credentials()
    spin_us: int = SPIN_US_DEFAULT


class NodeConnection:
    def __init__(self, options: ConnectOptions):
        """Hello over gRPC, then the first data path that works; raises what stopped it (Unavailable, ...)."""
        self.grpc = GrpcChannel(options.target, options.timeout_s, options.credentials)
        self.credentials = options.credentials
        # The node's own channel, answered in order: its Unix socket (which also hands out the arena) beside
        # shared memory, a call connection of its TCP data plane beside TCP pages.
        self.local: LocalChannel | TcpControlChannel | None = None
        self.data: DataPath | None = None
        try:
            self.hello = self.grpc.call("Hello", pb.HelloRequest(client_name=options.client_name))
            self.data = self._open_data_path(options)
            if self.data.name == "tcp" and self.hello.tcp_calls and options.control == "local":
                self.local = TcpControlChannel(self.hello.tcp_endpoint, options.timeout_s, options.tcp_congestion,
                                               self.hello.data_ticket, self._tcp_tls(options))
        except BaseException:
            self._close()
            raise
        self.control: Any = self.local if self.local is not None and options.control == "local" else self.grpc
        self.namespace_ids: dict[Namespace, int] = {}   # opened on this connection (node_calls.in_namespace)
        self.transfer = TransferRate()   # what its gets moved a second lately (load_estimate.py)
        self._lock = threading.Lock()
        self._users = 0
        self._retired = False

    @property
    def instance_id(self) -> bytes:
        return self.hello.instance_id

    def alive(self) -> bool:
        """False once the control channel or data path is known lost (cheap, no round trip)."""
        return self.data.alive() and self.control.alive()

    # -- namespaces -------------------------------------------------------------------

    def namespace_id(self, namespace: Namespace) -> int:
        """The namespace's id on this connection, opened first where it is not yet."""
        return self.reopening(namespace, lambda ns_id: ns_id)

    def reopening(self, namespace: Namespace, action: Callable[[int], T]) -> T:
        """Run action(namespace id) as node_calls.in_namespace runs an attempt: the namespace opened first, and
        again, with one retry, if the node does not know it (it restarted)."""
        def body(ns_id: int) -> Steps[T]:
            return action(ns_id)
            yield   # no steps of its own
        return drive(node_calls.in_namespace(self, namespace, body), take_on(self))

    def call_in(self, namespace: Namespace, method: str, request: Any) -> Any:
        """Call a namespace-scoped method, its namespace_id filled in (for tests and tools)."""
        return drive(node_calls.call_in(self, namespace, method, request), take_on(self))

    # -- lifetime ---------------------------------------------------------------------

    def enter(self) -> None:
        """A call starts using this connection; it is not closed before the matching leave()."""
        with self._lock:
            assert not self._retired or self._users, "a retired connection was entered after it closed"
            self._users += 1

    def leave(self) -> None:
        with self._lock:
            self._users -= 1
            close = self._retired and not self._users
        if close:
            self._close()

    def retire(self) -> None:
        """No new calls will use this connection: close it now, or when its last call leaves."""
        with self._lock:
            self._retired = True
            close = not self._users
        if close:
            self._close()

    def _close(self) -> None:
        if self.data is not None:
            self.data.close()
        if self.local is not None:
            self.local.close()
        self.grpc.close()

    # -- data path --------------------------------------------------------------------

    def _open_data_path(self, options: ConnectOptions) -> DataPath:
        from kvstore_client import rdma_transport  # imports pyverbs only when a device is looked for

        hello = self.hello
        order = candidates(options.transport, bool(hello.shm_socket), hello.rdma_enabled, bool(hello.tcp_endpoint),
                           hello.rdma_enabled and rdma_transport.device_present())
        failures = []
        for name in order:
            try:
                if name == "shm":
                    return self._open_shm(options)
                if name == "rdma":
                    return rdma_transport.RdmaDataPath(self.grpc, options.timeout_s, options.rdma)
                return TcpDataPath(hello.tcp_endpoint, options.timeout_s, options.tcp_congestion, hello.data_ticket,
                                   self._tcp_tls(options))
            except (errors.Unavailable, errors.PermissionDenied, errors.TransportUnavailable,
                    errors.CapacityExhausted) as exc:
                if options.transport != "auto":
                    raise
                log.info("data plane %s cannot be used, trying the next: %s", name, exc)
                failures.append(f"{name}: {exc}")
        raise errors.TransportUnavailable("no data plane of the node works from here: " + "; ".join(failures))

    def _tcp_tls(self, options: ConnectOptions) -> ssl.SSLContext | None:
        return options.credentials.tcp_tls() if self.hello.tcp_tls else None

    def _open_shm(self, options: ConnectOptions) -> ShmDataPath:
        local = LocalChannel(self.hello.shm_socket, options.timeout_s, self.credentials.token,
                             (self.hello.local_challenge, self.hello.local_answer), options.spin_us / 1e6)
        try:
            path = ShmDataPath(local, self.hello.instance_id, commits_here=options.control == "local")
        except BaseException:
            local.close()
            raise
        self.local = local
        return path
