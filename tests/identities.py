"""Test identities: token files and a throwaway CA with server and client certificates, made at test time."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def token_line(token: str, tenant: str, role: str = "tenant", expires: str = "") -> str:
    return f"{hashlib.sha256(token.encode()).hexdigest()} {tenant} {role} {expires}".rstrip() + "\n"


class Tokens:
    """A token file with alice and bob (tenants) and ops (admin); more may be written."""

    def __init__(self, directory: Path):
        self.path = directory / "tokens"
        self.alice, self.bob, self.ops = (secrets.token_urlsafe(24) for _ in range(3))
        self.lines = [token_line(self.alice, "alice"), token_line(self.bob, "bob"), token_line(self.ops, "ops", "admin")]
        self.write()

    def write(self) -> None:
        self.path.write_text("# sha256 tenant role [expires]\n" + "".join(self.lines))


def _key_and_name(common_name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    return key, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(directory: Path, stem: str, key, cert) -> tuple[str, str]:
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


class Certificates:
    """A CA; a server certificate for 127.0.0.1 and localhost; client certificates naming tenants."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._now = datetime.datetime.now(datetime.timezone.utc)
        self._ca_key, name = _key_and_name("kvstore test CA")
        self._ca_name = name
        self._ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                    .public_key(self._ca_key.public_key()).serial_number(x509.random_serial_number())
                    .not_valid_before(self._now - datetime.timedelta(minutes=5))
                    .not_valid_after(self._now + datetime.timedelta(days=1))
                    .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                    .sign(self._ca_key, hashes.SHA256()))
        self.ca = str(directory / "ca.pem")
        Path(self.ca).write_bytes(self._ca.public_bytes(serialization.Encoding.PEM))
        self.server_cert, self.server_key = self.issue("server", "kvstore-node",
                                                       [x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")])

    def issue(self, stem: str, common_name: str, names: list | None = None) -> tuple[str, str]:
        key, subject = _key_and_name(common_name)
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(self._ca_name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(self._now - datetime.timedelta(minutes=5))
                   .not_valid_after(self._now + datetime.timedelta(days=1)))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return _write(self.directory, stem, key, builder.sign(self._ca_key, hashes.SHA256()))
