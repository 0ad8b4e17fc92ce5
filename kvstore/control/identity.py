"""Who is calling: an identity (a tenant and a role), and how each plane resolves one.

gRPC: a bearer token in the call's metadata (`authorization: Bearer <token>`), a client
certificate (mutual TLS: its common name is the tenant), or both, which must agree. Local
socket: the peer's uid (SO_PEERCRED), mapped by auth.local_uids. TCP data plane: in the
connection's first frame, the data ticket a gRPC Hello handed out, the identity
sealed (HMAC) by this node process, valid for TICKET_TTL_S, so a bearer token never crosses
the plaintext data plane and a client certificate's identity carries over too. A ticket
sealed from a token carries the token's digest: a connection it opened is refused on its next
frame once the token is revoked or expires (TokenStanding), not only new calls.

The token file holds SHA-256 digests of tokens, never tokens, one per line:

    # sha256(token) hex                                              tenant  role    [expires, UTC]
    5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8 alice   tenant
    9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 ops     admin   2027-01-01T00:00:00

A presented token is hashed and compared with every digest in constant time
(hmac.compare_digest, no early exit), so the time of a refusal says nothing about which
digests exist. SIGHUP rereads the file (server.py); a file that does not parse keeps the
table in force and is reported. With no authentication configured every caller is
TRUSTED: the one implicit tenant with the admin role, as a node on loopback always was.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import logging
import secrets
import struct
import threading
import time
from typing import Iterable, Sequence

from kvstore.config import AuthConfig
from kvstore_client import errors

log = logging.getLogger(__name__)

TENANT = "tenant"
ADMIN = "admin"
BEARER = "bearer "
TENANT_BYTES_MAX = 255
# A data ticket (Hello's data_ticket) opens TCP data connections for this long after it was issued.
TICKET_TTL_S = 300.0
_TICKET_HEAD = struct.Struct("<BdBB")  # admin flag, expiry (time.time()), tenant length, token digest length
_TICKET_MAC_BYTES = 16


@dataclasses.dataclass(frozen=True)
class Identity:
    tenant: str
    role: str
    # The SHA-256 of the token it was proven with (b"" for a uid or a certificate): a connection
    # opened with a token is checked against the table in force on each frame (TokenStanding).
    token_digest: bytes = dataclasses.field(default=b"", compare=False, repr=False)

    @property
    def admin(self) -> bool:
        return self.role == ADMIN


TRUSTED = Identity(tenant="", role=ADMIN)


class Caller:
    """Who calls, as the service sees it: one local connection (its leases end when it closes)
    or one gRPC call (its leases end by their TTL), and the identity it proved."""

    __slots__ = ("identity", "arena")

    def __init__(self, identity: Identity):
        self.identity = identity
        self.arena: str | None = None   # the tenant whose memfd this local connection mapped, if any


@dataclasses.dataclass(frozen=True)
class TokenEntry:
    digest: bytes
    identity: Identity
    expires_at: float           # time.time(); 0 = never


def token_digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


def read_token_file(path: str) -> list[TokenEntry]:
    """The entries of a token file; ValueError names the line that cannot be read."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    entries = []
    lines_by_digest: dict[bytes, int] = {}
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{path}:{number}"
        if len(fields) not in (3, 4):
            raise ValueError(f"{where}: expected '<sha256 hex> <tenant> <tenant|admin> [expires]', got {len(fields)} fields")
        digest_hex, tenant, role = fields[:3]
        if len(tenant.encode()) > TENANT_BYTES_MAX:
            raise ValueError(f"{where}: a tenant name is at most {TENANT_BYTES_MAX} bytes")
        try:
            digest = bytes.fromhex(digest_hex)
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ValueError(f"{where}: the first field must be a token's SHA-256 digest, 64 hex digits")
        if digest in lines_by_digest:   # which tenant would it be? the file says two things
            raise ValueError(f"{where}: the same token digest as line {lines_by_digest[digest]}: "
                             "list each token once")
        lines_by_digest[digest] = number
        if role not in (TENANT, ADMIN):
            raise ValueError(f"{where}: role {role!r} must be 'tenant' or 'admin'")
        expires_at = 0.0
        if len(fields) == 4:
            try:
                when = datetime.datetime.fromisoformat(fields[3])
            except ValueError:
                raise ValueError(f"{where}: expiry {fields[3]!r} is not an ISO 8601 time (2027-01-01T00:00:00)") from None
            if when.tzinfo is None:
                when = when.replace(tzinfo=datetime.timezone.utc)
            expires_at = when.timestamp()
        entries.append(TokenEntry(digest, Identity(tenant, role, token_digest=digest), expires_at))
    return entries


class TokenTable:
    """The token file in force; reload() swaps in a new one whole, or keeps the old one."""

    def __init__(self, path: str):
        self.path = path
        self._entries: tuple[TokenEntry, ...] = tuple(read_token_file(path)) if path else ()
        self._lock = threading.Lock()
        self.generation = 0     # counts reloads: a connection's standing is looked up again after one

    def __len__(self) -> int:
        return len(self._entries)

    def reload(self) -> int:
        """Reread the file; returns its entries. On OSError/ValueError the old table stays."""
        entries = tuple(read_token_file(self.path))
        with self._lock:
            self._entries = entries
            self.generation += 1
        return len(entries)

    def resolve(self, token: str, now: float | None = None) -> Identity:
        return self.entry(token_digest(token), now).identity

    def entry(self, digest: bytes, now: float | None = None) -> TokenEntry:
        """The entry in force for a token's digest; Unauthenticated when it is unknown, revoked or expired."""
        found: TokenEntry | None = None
        for entry in self._entries:   # every entry, no early exit: constant time in where it matched
            if hmac.compare_digest(entry.digest, digest):
                found = entry
        if found is None:
            raise errors.Unauthenticated(
                "the bearer token is not one this node knows (wrong, or revoked from auth.tokens_file): "
                "ask the operator for a valid token")
        if found.expires_at and (time.time() if now is None else now) >= found.expires_at:
            raise errors.Unauthenticated("the bearer token has expired: ask the operator for a new one")
        return found


class TokenStanding:
    """Whether the token a connection was opened with is still in force, asked on each of its frames.

    Revoking a token (removing its line, SIGHUP) or its expiry then refuses the next frame of
    every TCP and local connection it opened, not only new calls. Cheap per frame: the table is
    searched again only after a reload or once the token's expiry has passed.
    """

    __slots__ = ("_auth", "_digest", "_generation", "_expires_at")

    def __init__(self, auth: "Authenticator", identity: Identity):
        self._auth = auth
        self._digest = identity.token_digest
        self._generation = -1
        self._expires_at = 0.0

    def check(self, plane: str) -> None:
        if not self._digest:
            return   # a uid or a certificate: nothing a token file revokes
        tokens = self._auth.tokens
        if self._generation == tokens.generation and not (self._expires_at and time.time() >= self._expires_at):
            return
        generation = tokens.generation
        try:
            entry = tokens.entry(self._digest)
        except errors.KVStoreError as exc:
            self._auth.refused(plane, exc)
            raise
        self._generation, self._expires_at = generation, entry.expires_at


def bearer_token(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The token of an `authorization: Bearer <token>` entry; None when there is none."""
    for key, value in metadata:
        if key == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            if not text.lower().startswith(BEARER):
                raise errors.Unauthenticated("the authorization metadata must read 'Bearer <token>'")
            return text[len(BEARER):].strip()
    return None


class Authenticator:
    """Resolves a caller on each plane to an Identity, or refuses it; counts the refusals."""

    def __init__(self, config: AuthConfig):
        self.config = config
        self.enabled = config.enabled
        self.tokens = TokenTable(config.tokens_file)
        self.local_uids = _uid_map(config.local_uids)
        self.refusals: dict[tuple[str, str], int] = {}    # (plane, error class) -> calls refused
        self._refusals_lock = threading.Lock()
        self._ticket_key = secrets.token_bytes(32)          # this process's; tickets die with it

    def ticket(self, identity: Identity, now: float | None = None) -> bytes:
        """The identity sealed for the TCP data plane: it opens connections for TICKET_TTL_S."""
        if not self.enabled:
            return b""
        tenant = identity.tenant.encode()
        body = _TICKET_HEAD.pack(identity.admin, (time.time() if now is None else now) + TICKET_TTL_S,
                                 len(tenant), len(identity.token_digest)) + tenant + identity.token_digest
        return body + hmac.new(self._ticket_key, body, hashlib.sha256).digest()[:_TICKET_MAC_BYTES]

    def ticket_identity(self, ticket: bytes, now: float | None = None) -> Identity:
        """The identity a TCP connection's HELLO shows; Unauthenticated (counted) when it is not one this node sealed."""
        if not self.enabled:
            return TRUSTED
        body, mac = ticket[:-_TICKET_MAC_BYTES], ticket[-_TICKET_MAC_BYTES:]
        expected = hmac.new(self._ticket_key, body, hashlib.sha256).digest()[:_TICKET_MAC_BYTES]
        try:
            if len(ticket) < _TICKET_HEAD.size + _TICKET_MAC_BYTES or not hmac.compare_digest(mac, expected):
                raise errors.Unauthenticated(
                    "the data ticket is not one this node issued (or the node restarted): send the data_ticket of "
                    "a Hello to this node in the connection's first frame")
            admin, expires_at, tenant_bytes, _ = _TICKET_HEAD.unpack_from(body)
            if (time.time() if now is None else now) >= expires_at:
                raise errors.Unauthenticated("the data ticket has expired: call Hello again for a fresh one")
        except errors.KVStoreError as exc:
            self.refused("tcp", exc)
            raise
        tenant_end = _TICKET_HEAD.size + tenant_bytes
        return Identity(body[_TICKET_HEAD.size:tenant_end].decode(), ADMIN if admin else TENANT,
                        token_digest=body[tenant_end:])

    def in_force(self, token_digest: bytes) -> bool:
        """Whether the token with this digest is in the table and not expired."""
        try:
            self.tokens.entry(token_digest)
        except errors.KVStoreError:
            return False
        return True

    def reload(self) -> None:
        """SIGHUP: reread the token file; a bad file is reported and the table in force kept."""
        if not self.config.tokens_file:
            return
        try:
            count = self.tokens.reload()
        except (OSError, ValueError) as exc:
            log.error("token file not reloaded, the previous one stays in force: %s", exc)
            return
        log.info("token file reloaded path=%s tokens=%d", self.config.tokens_file, count)

    def grpc_identity(self, metadata: Sequence[tuple[str, str | bytes]], certificate_tenant: str | None) -> Identity:
        """A call's identity from its token and (mutual TLS) its certificate's tenant."""
        if not self.enabled:
            return TRUSTED
        try:
            return self._grpc_identity(metadata, certificate_tenant)
        except errors.KVStoreError as exc:
            self.refused("grpc", exc)
            raise

    def _grpc_identity(self, metadata: Sequence[tuple[str, str | bytes]], certificate_tenant: str | None) -> Identity:
        if not self.config.tls_client_ca:
            certificate_tenant = None   # only a certificate this node's client CA verified names a tenant
        token = bearer_token(metadata)
        if token is None:
            if certificate_tenant:
                return Identity(certificate_tenant, TENANT)
            raise errors.Unauthenticated(
                "this node needs a bearer token: pass token= to KVStoreClient (or set KVSTORE_TOKEN), "
                "sent as 'authorization: Bearer <token>'")
        identity = self.tokens.resolve(token)
        if certificate_tenant and certificate_tenant != identity.tenant:
            raise errors.PermissionDenied(
                f"the client certificate names tenant {certificate_tenant!r} but the token is another tenant's: "
                "use the certificate and token of one tenant")
        return identity

    def token_identity(self, token: str) -> Identity:
        """The identity of a bearer token alone (metrics scrapes); the caller counts refusals."""
        if not self.enabled:
            return TRUSTED
        return self.tokens.resolve(token)

    def local_identity(self, uid: int) -> Identity:
        """A local-socket peer's identity from its uid."""
        if not self.enabled:
            return TRUSTED
        identity = self.local_uids.get(uid)
        if identity is None:
            exc = errors.PermissionDenied(
                f"uid {uid} maps to no tenant on this node: add 'uid:tenant' to auth.local_uids, "
                "or use gRPC and TCP with a token")
            self.refused("local", exc)
            raise exc
        return identity

    def local_token_identity(self, uid_identity: Identity, token: str) -> Identity:
        """A local connection's identity once it showed a token: the uid's tenant, proven twice.

        The token must be one of the uid's tenant; the admin role needs both the uid and the token to be admin's.
        """
        if not self.enabled:
            return uid_identity
        try:
            if not token:
                raise errors.Unauthenticated("the local socket's AUTHENTICATE frame carries no token: pass token= "
                                             "to KVStoreClient (or set KVSTORE_TOKEN)")
            token_identity = self.tokens.resolve(token)
            if token_identity.tenant != uid_identity.tenant:
                raise errors.PermissionDenied(
                    f"this uid maps to tenant {uid_identity.tenant!r} (auth.local_uids) but the token is another "
                    "tenant's: use the token of the uid's tenant")
        except errors.KVStoreError as exc:
            self.refused("local", exc)
            raise
        role = ADMIN if uid_identity.admin and token_identity.admin else TENANT
        return Identity(uid_identity.tenant, role, token_digest=token_identity.token_digest)

    def refusal_counts(self) -> dict[tuple[str, str], int]:
        with self._refusals_lock:
            return dict(self.refusals)

    def refused(self, plane: str, exc: errors.KVStoreError) -> None:
        key = (plane, type(exc).__name__)
        with self._refusals_lock:
            self.refusals[key] = self.refusals.get(key, 0) + 1


def _uid_map(entries: Sequence[str]) -> dict[int, Identity]:
    mapping = {}
    for entry in entries:   # checked by config: "uid:tenant" or "uid:tenant:admin"
        uid, tenant, *admin = entry.split(":")
        mapping[int(uid)] = Identity(tenant, ADMIN if admin else TENANT)
    return mapping


def certificate_tenant(auth_context: dict[str, list[bytes]]) -> str | None:
    """The tenant a verified client certificate names: its common name, else its first SAN."""
    for field in ("x509_common_name", "x509_subject_alternative_name"):
        names = auth_context.get(field)
        if names:
            return names[0].decode(errors="replace")
    return None
