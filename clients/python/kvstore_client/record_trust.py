"""Member records that prove who wrote them: a node signs its record; a client places pages only on those it can check.

Why signatures, and not only a locked etcd: whoever can write to etcd (an operator's tool, a
leaked etcd certificate, a compromised etcd member) could otherwise register a node, or point a
real node's record at another address, and clients would send it tokens and pages. A record
signed by the node's own key, under a certificate the cluster's CA issued for that node id,
cannot be forged by writing to etcd: etcd keeps records, it does not vouch for them.

- A node that serves gRPC over TLS (auth.tls_cert, auth.tls_key) puts its certificate in its
  record and signs the record with its key (`sign`); the certificate must name the node id as
  a DNS name (checked at start-up: `names`).
- A client given the CA (tls_ca) checks each record (`RecordTrust.problem`): issued by the CA,
  valid now, naming the record's node id, and signed by that certificate's key. A record that
  fails is ignored and logged; no page is placed on it, and no call is made to it.
- A record proves only who wrote it. The address in it could be replayed from an old record;
  so the client also dials the node with TLS checking that the certificate names the node id
  (grpc.ssl_target_name_override), before any token or page goes out.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import logging

from kvstore_client.membership import Member

log = logging.getLogger(__name__)


def _crypto():
    try:
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
    except ImportError as exc:
        raise ImportError(f"signed member records need cryptography ({exc}): pip install 'kvstore-client[cluster]'")
    return x509, InvalidSignature, hashes, serialization, ec, ed25519, padding, rsa


def signed_bytes(member: Member) -> bytes:
    """What a record's signature covers: every field, the certificate included, but the signature."""
    return dataclasses.replace(member, signature="").encode()


def names(cert_pem: bytes) -> list[str]:
    """The DNS names a certificate carries (its subject alternative names)."""
    x509 = _crypto()[0]
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        extension = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return extension.value.get_values_for_type(x509.DNSName)


def sign(member: Member, cert_pem: bytes, key_pem: bytes) -> Member:
    """The record with this certificate in it, signed with its key."""
    x509, _, hashes, serialization, ec, ed25519, padding, rsa = _crypto()
    key = serialization.load_pem_private_key(key_pem, password=None)
    first_cert = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.PEM).decode()
    unsigned = dataclasses.replace(member, cert=first_cert, signature="")
    data = signed_bytes(unsigned)
    if isinstance(key, ec.EllipticCurvePrivateKey):
        signature = key.sign(data, ec.ECDSA(hashes.SHA256()))
    elif isinstance(key, rsa.RSAPrivateKey):
        signature = key.sign(data, padding.PKCS1v15(), hashes.SHA256())
    elif isinstance(key, ed25519.Ed25519PrivateKey):
        signature = key.sign(data)
    else:
        raise ValueError(f"a {type(key).__name__} cannot sign member records: use an EC, RSA or Ed25519 key")
    return dataclasses.replace(unsigned, signature=base64.b64encode(signature).decode())


class RecordTrust:
    """Checks member records against the cluster's CA (a PEM file)."""

    def __init__(self, ca_path: str):
        x509 = _crypto()[0]
        with open(ca_path, "rb") as f:
            self._cas = x509.load_pem_x509_certificates(f.read())

    def problem(self, member: Member) -> str:
        """Why the record cannot be trusted; "" when it proves itself."""
        x509, InvalidSignature, hashes, _, ec, ed25519, padding, rsa = _crypto()
        if not member.cert or not member.signature:
            return "it is not signed (the node needs auth.tls_cert and auth.tls_key)"
        try:
            cert = x509.load_pem_x509_certificate(member.cert.encode())
            signature = base64.b64decode(member.signature, validate=True)
        except ValueError as exc:
            return f"its certificate or signature cannot be read ({exc})"
        if not any(_issued_by(cert, ca) for ca in self._cas):
            return f"its certificate ({cert.subject.rfc4514_string()}) is not issued by the cluster's CA (tls_ca)"
        now = datetime.datetime.now(datetime.timezone.utc)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            return f"its certificate is not valid now (valid {cert.not_valid_before_utc} to {cert.not_valid_after_utc})"
        if member.node_id not in names(member.cert.encode()):
            return f"its certificate does not name node id {member.node_id!r} (a DNS name of its subject alt names)"
        key, data = cert.public_key(), signed_bytes(member)
        try:
            if isinstance(key, ec.EllipticCurvePublicKey):
                key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
            elif isinstance(key, rsa.RSAPublicKey):
                key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
            elif isinstance(key, ed25519.Ed25519PublicKey):
                key.verify(signature, data)
            else:
                return f"its certificate's {type(key).__name__} key cannot sign records"
        except InvalidSignature:
            return "its signature does not match its content (it was changed after the node signed it)"
        return ""


def _issued_by(cert, ca) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
        return True
    except Exception:   # another issuer, a signature that does not verify, or a key type it cannot check
        return False
