"""The closed set of kvstore errors: one exception per code, one table to gRPC status.

The server raises these; the table turns them into a gRPC status plus the code in
trailing metadata, and the client turns both back into the same exception. A cache
miss is never an error: it is a hit count below the number of keys asked for.
"""

from __future__ import annotations

import grpc

from kvstore_client.proto import pb

ERROR_CODE_METADATA_KEY = "kvstore-error-code"


class KVStoreError(Exception):
    """Base of every kvstore error. `code` is the wire ErrorCode."""

    code: int = pb.INTERNAL
    status: grpc.StatusCode = grpc.StatusCode.INTERNAL


def _error(name: str, code: int, status: grpc.StatusCode, doc: str,
           base: type[Exception] = KVStoreError) -> type[KVStoreError]:
    return type(name, (base,), {"code": code, "status": status, "__doc__": doc})


# Also a ValueError: code that guards a call with `except ValueError` keeps working. The errors
# below that name a bad argument more precisely are InvalidArguments too.
InvalidArgument = type("InvalidArgument", (KVStoreError, ValueError), {
    "code": pb.INVALID_ARGUMENT, "status": grpc.StatusCode.INVALID_ARGUMENT,
    "__doc__": "A field is empty or out of range. Fix the request; retrying it unchanged fails again."})
NamespaceNotFound = _error(
    "NamespaceNotFound", pb.NAMESPACE_NOT_FOUND, grpc.StatusCode.NOT_FOUND,
    "The namespace id was never opened on this server (or the server restarted): open it again.")
PageSizeMismatch = _error(
    "PageSizeMismatch", pb.PAGE_SIZE_MISMATCH, grpc.StatusCode.INVALID_ARGUMENT,
    "A page's size differs from the namespace's page_bytes: the KV layout does not match.", InvalidArgument)
LeaseNotFound = _error(
    "LeaseNotFound", pb.LEASE_NOT_FOUND, grpc.StatusCode.NOT_FOUND,
    "The lease is unknown, already finished, or expired. Redo the reserve or acquire.")
ChecksumMismatch = _error(
    "ChecksumMismatch", pb.CHECKSUM_MISMATCH, grpc.StatusCode.DATA_LOSS,
    "Slot bytes do not hash to the checksum given at commit; nothing was made visible.")
DuplicateKey = _error(
    "DuplicateKey", pb.DUPLICATE_KEY, grpc.StatusCode.INVALID_ARGUMENT,
    "A key appears twice in one batch. Deduplicate the batch.", InvalidArgument)
BatchTooLarge = _error(
    "BatchTooLarge", pb.BATCH_TOO_LARGE, grpc.StatusCode.INVALID_ARGUMENT,
    "More pages in one call than limits.batch_pages_max. Split the batch.", InvalidArgument)
CapacityExhausted = _error(
    "CapacityExhausted", pb.CAPACITY_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    "No slot could be freed: every page is pinned by a lease. Release leases or retry later.")
Draining = _error(
    "Draining", pb.DRAINING, grpc.StatusCode.UNAVAILABLE,
    "The server is shutting down and takes no new leases. Retry on another node or later.")
PermissionDenied = _error(
    "PermissionDenied", pb.PERMISSION_DENIED, grpc.StatusCode.PERMISSION_DENIED,
    "The caller's identity may not do this: its uid is not allowed (shm.allowed_uids, auth.local_uids), the "
    "request names another tenant, or the call needs the admin role. The message says which.")
Unauthenticated = _error(
    "Unauthenticated", pb.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED,
    "The node needs to know who calls: no token was sent, or it is wrong, expired or revoked. Pass "
    "token= (or KVSTORE_TOKEN) with a token the operator listed in auth.tokens_file.")
MalformedRequest = _error(
    "MalformedRequest", pb.MALFORMED_REQUEST, grpc.StatusCode.INVALID_ARGUMENT,
    "The request bytes are not a valid message of the method's type.", InvalidArgument)
Internal = _error(
    "Internal", pb.INTERNAL, grpc.StatusCode.INTERNAL,
    "A server bug. Report it with the server log; the request may be retried.")
TokenMismatch = _error(
    "TokenMismatch", pb.TOKEN_MISMATCH, grpc.StatusCode.PERMISSION_DENIED,
    "A data-plane frame carried a token that is not its lease's. Use data_token from Reserve/Acquire.")
SlotNotInLease = _error(
    "SlotNotInLease", pb.SLOT_NOT_IN_LEASE, grpc.StatusCode.INVALID_ARGUMENT,
    "A data-plane frame named a slot its lease does not hold (committed, unknown, or a read of a write lease).")
LengthMismatch = _error(
    "LengthMismatch", pb.LENGTH_MISMATCH, grpc.StatusCode.INVALID_ARGUMENT,
    "A data-plane frame's length is not the page's page_bytes. Move whole pages.")
SlotBusy = _error(
    "SlotBusy", pb.SLOT_BUSY, grpc.StatusCode.FAILED_PRECONDITION,
    "Bytes are still moving into the slot. Wait for its transfer's answer, then commit.")
TransportUnavailable = _error(
    "TransportUnavailable", pb.TRANSPORT_UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
    "The asked-for data plane (shm, tcp, rdma) is not offered by the node or cannot run on this host.")
GroupIncomplete = _error(
    "GroupIncomplete", pb.GROUP_INCOMPLETE, grpc.StatusCode.FAILED_PRECONDITION,
    "A page of a group commit could not be published (its parent left the store): nothing of the group "
    "became visible. Abort its leases and put the group again.")
Unavailable = _error(
    "Unavailable", pb.ERROR_CODE_UNSPECIFIED, grpc.StatusCode.UNAVAILABLE,
    "The node could not be reached, or stopped during the call. Treat it as a miss or retry: the client "
    "reconnects by itself on its next call (once the node is back).")
DeadlineExceeded = _error(
    "DeadlineExceeded", pb.ERROR_CODE_UNSPECIFIED, grpc.StatusCode.DEADLINE_EXCEEDED,
    "The call did not finish within its deadline. Treat as a miss or retry.")

ERRORS_BY_CODE: dict[int, type[KVStoreError]] = {
    cls.code: cls
    for cls in (InvalidArgument, NamespaceNotFound, PageSizeMismatch, LeaseNotFound,
                ChecksumMismatch, DuplicateKey, BatchTooLarge, CapacityExhausted, Draining,
                PermissionDenied, MalformedRequest, Internal, TokenMismatch, SlotNotInLease, LengthMismatch,
                SlotBusy, TransportUnavailable, Unauthenticated, GroupIncomplete)
}

# gRPC statuses that carry no kvstore code (raised by gRPC itself, not our server).
_ERRORS_BY_STATUS: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Unavailable,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


def error_from_code(code: int, message: str) -> KVStoreError:
    return ERRORS_BY_CODE.get(code, Internal)(message)


def error_from_rpc(exc: grpc.RpcError) -> KVStoreError:
    """Rebuild the server's exception from a failed gRPC call."""
    status = exc.code()
    message = exc.details() or status.name
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_CODE_METADATA_KEY:
            return error_from_code(int(value), message)
    if status == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = f"no answer within the call's deadline (the client's or the call's timeout_s): {message}"
    return _ERRORS_BY_STATUS.get(status, Internal)(message)
