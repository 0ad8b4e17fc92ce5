"""What a client proves about itself to a node: a bearer token and/or TLS files.

    KVStoreClient(target, token="...", tls_ca="ca.pem")                      # token over TLS
    KVStoreClient(target, tls_ca="ca.pem", tls_cert="alice.pem", tls_key="alice.key")   # mutual TLS

Each argument left out is read from the environment: KVSTORE_TOKEN, KVSTORE_TLS_CA,
KVSTORE_TLS_CERT, KVSTORE_TLS_KEY (and, for a cluster's etcd, KVSTORE_ETCD_TLS_CA, _CERT, _KEY:
EtcdTlsFiles). The token travels in every call's metadata as
`authorization: Bearer <token>` and, on the TCP data plane, in the connection's first frame.
With tls_ca the gRPC channel speaks TLS and checks the node's certificate against that CA.
"""

from __future__ import annotations

import dataclasses
import os
import ssl
from typing import Any, Mapping

import grpc
import grpc.aio

from kvstore_client.errors import InvalidArgument

ENV = {"token": "KVSTORE_TOKEN", "tls_ca": "KVSTORE_TLS_CA", "tls_cert": "KVSTORE_TLS_CERT",
       "tls_key": "KVSTORE_TLS_KEY"}


@dataclasses.dataclass(frozen=True)
class Credentials:
    token: str = ""
    tls_ca: str = ""            # PEM file of the CA that signed the node's certificate; "" = plaintext gRPC
    tls_cert: str = ""          # PEM file of this client's certificate (mutual TLS)
    tls_key: str = ""           # PEM file of its private key
    tls_server_name: str = ""   # the name the node's certificate must carry; "" = the host dialled (a cluster
                                # client gives the node id: the record's address alone proves nothing)

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, **given: str | None) -> "Credentials":
        """The given values, each one not given (None) taken from its KVSTORE_* variable."""
        environ = os.environ if environ is None else environ
        values = {name: given.get(name) if given.get(name) is not None else environ.get(variable, "")
                  for name, variable in ENV.items()}
        credentials = cls(**values, tls_server_name=given.get("tls_server_name") or "")
        if bool(credentials.tls_cert) != bool(credentials.tls_key):
            raise InvalidArgument("tls_cert and tls_key go together (a client certificate and its key), or neither")
        if credentials.tls_cert and not credentials.tls_ca:
            raise InvalidArgument("tls_cert needs tls_ca: the CA that signed the node's certificate")
        return credentials

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("authorization", f"Bearer {self.token}"),) if self.token else None

    def channel(self, target: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        if not self.tls_ca:
            return grpc.insecure_channel(target, options=options)
        return grpc.secure_channel(target, self._ssl(), options=self._named(options))

    def aio_channel(self, target: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        """The same channel for asyncio (async_client.py)."""
        if not self.tls_ca:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(target, self._ssl(), options=self._named(options))

    def _named(self, options: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        if not self.tls_server_name:
            return options
        return [*options, ("grpc.ssl_target_name_override", self.tls_server_name)]

    def tcp_tls(self) -> ssl.SSLContext:
        """The TLS context for a node's TCP data plane (Hello's tcp_tls): the node's certificate is checked
        against tls_ca, the CA trusted for gRPC (the system's CAs without one)."""
        try:
            return ssl.create_default_context(cafile=self.tls_ca or None)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidArgument(f"cannot read tls_ca {self.tls_ca}: {exc}") from None

    def _ssl(self) -> grpc.ChannelCredentials:
        files = [_read(path, name) if path else None for path, name in
                 ((self.tls_ca, "tls_ca"), (self.tls_key, "tls_key"), (self.tls_cert, "tls_cert"))]
        return grpc.ssl_channel_credentials(*files)


def _read(path: str, name: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {name} {path}: {exc.strerror}") from None


ETCD_ENV = {"ca": "KVSTORE_ETCD_TLS_CA", "cert": "KVSTORE_ETCD_TLS_CERT", "key": "KVSTORE_ETCD_TLS_KEY"}


@dataclasses.dataclass(frozen=True)
class EtcdTlsFiles:
    """PEM files for etcd over TLS: the CA of etcd's certificate, and this side's certificate and key."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    @classmethod
    def resolve(cls, environ: Any = None, **given: str | None) -> "EtcdTlsFiles | None":
        """The given files, each one not given (None) read from KVSTORE_ETCD_TLS_*; None when there are none."""
        environ = os.environ if environ is None else environ
        files = cls(**{name: given.get(name) if given.get(name) is not None else environ.get(variable, "")
                       for name, variable in ETCD_ENV.items()})
        if bool(files.cert) != bool(files.key):
            raise InvalidArgument("an etcd client certificate and its key go together (etcd_tls_cert, etcd_tls_key)")
        return files if (files.ca or files.cert) else None

    def credentials(self) -> grpc.ChannelCredentials:
        files = [_read(path, name) if path else None for path, name in
                 ((self.ca, "etcd_tls_ca"), (self.key, "etcd_tls_key"), (self.cert, "etcd_tls_cert"))]
        return grpc.ssl_channel_credentials(*files)
