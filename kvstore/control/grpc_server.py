"""kvstore.v1.KVStore over gRPC: a thin carrier from wire bytes to KVStoreService.

Requests are parsed here rather than by gRPC, so a malformed message gets
INVALID_ARGUMENT with a readable reason instead of gRPC's generic INTERNAL. A broken
invariant (AssertionError) stops the node (kvstore/invariants.py) rather than being
answered INTERNAL; any other unexpected exception is answered INTERNAL.

Every call's identity is resolved first, from its metadata, before its request is even
received (identity.py): a missing, wrong or revoked token is answered UNAUTHENTICATED, a token
and client certificate of different tenants PERMISSION_DENIED. For that, each method is served
as stream-unary, which lets the handler take the one request message when it chooses (the
wire is the same as unary): a caller without a token costs the node its HTTP/2 window, never a
message of up to FRAME_BYTES_MAX held for it. With auth.tls_cert the port
speaks TLS only; with auth.tls_client_ca it asks every client for a certificate signed by
that CA (mutual TLS) and the certificate's common name is the caller's tenant.
"""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Any, Callable, Iterator

import grpc
from google.protobuf.message import DecodeError

from kvstore.config import AuthConfig
from kvstore.control.identity import TRUSTED, Authenticator, Caller, certificate_tenant
from kvstore.control.service import KVStoreService
from kvstore.invariants import stop_node
from kvstore_client import errors, framing

log = logging.getLogger(__name__)

SERVICE_NAME = "kvstore.v1.KVStore"


def _unary(service: KVStoreService, auth: Authenticator, name: str,
           request_cls: type) -> Callable[[Iterator[bytes], grpc.ServicerContext], Any]:
    def handler(messages: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        try:
            identity = auth.grpc_identity(context.invocation_metadata(),
                                          certificate_tenant(context.auth_context())) if auth.enabled else TRUSTED
            raw = next(messages, None)   # received only now, once the caller is known
            if raw is None:
                raise errors.MalformedRequest(f"{name}: the call carried no request message")
            try:
                request = request_cls.FromString(raw)
            except DecodeError as exc:
                raise errors.MalformedRequest(f"{name}: request is not a valid {request_cls.__name__}: {exc}") from None
            response = service.handle(name, request, Caller(identity))
            if name == "Hello":
                response.data_ticket = auth.ticket(identity)
            return response
        except errors.KVStoreError as exc:
            context.set_trailing_metadata(((errors.ERROR_CODE_METADATA_KEY, str(exc.code)),))
            context.abort(exc.status, str(exc))
        except AssertionError as exc:
            stop_node("the gRPC carrier", exc)
        except Exception:
            log.exception("%s failed", name)
            context.set_trailing_metadata(((errors.ERROR_CODE_METADATA_KEY, str(errors.Internal.code)),))
            context.abort(grpc.StatusCode.INTERNAL, f"{name}: internal error, see the server log")
    return handler


def create_server(service: KVStoreService, address: str, workers: int,
                  auth: Authenticator | None = None) -> tuple[grpc.Server, int]:
    """A started-ready (not yet started) gRPC server bound to `address`, and its port."""
    auth = auth or Authenticator(AuthConfig())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
                         options=[("grpc.max_receive_message_length", framing.FRAME_BYTES_MAX),
                                  ("grpc.so_reuseport", 0)])
    handlers = {
        name: grpc.stream_unary_rpc_method_handler(
            _unary(service, auth, name, request_cls), response_serializer=response_cls.SerializeToString)
        for name, request_cls, response_cls in framing.METHODS.values()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    credentials = _server_credentials(auth.config)
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # newer grpcio raises where older ones returned 0
        port = 0
    if port == 0:
        raise OSError(f"cannot bind gRPC to {address} (server.grpc_address): address in use or not local")
    return server, port


def _server_credentials(config: AuthConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert:
        return None
    pem = {}
    for setting in ("tls_cert", "tls_key", "tls_client_ca"):
        path = getattr(config, setting)
        try:
            pem[setting] = open(path, "rb").read() if path else None
        except OSError as exc:
            raise OSError(f"cannot read auth.{setting} {path}: {exc.strerror}") from None
    return grpc.ssl_server_credentials([(pem["tls_key"], pem["tls_cert"])], root_certificates=pem["tls_client_ca"],
                                       require_client_auth=pem["tls_client_ca"] is not None)
