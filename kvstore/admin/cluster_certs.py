"""`kvstore cluster certs DIR --nodes n1,n2,n3`: a cluster's CA and every certificate its etcd, nodes and clients need.

    DIR/ca.pem, ca.key             the cluster's CA (keep ca.key offline once the certificates are made)
    DIR/etcd.pem, etcd.key         etcd's server certificate, for --etcd-names (its host names and addresses)
    DIR/etcd-client.pem, .key      what nodes and clients present to etcd (etcd runs --client-cert-auth)
    DIR/node-<id>.pem, .key        each node's gRPC certificate: its id as a DNS name (what clients check, and
                                   what its signed member record carries), then --node-names

ECDSA P-256 keys, SHA-256 signatures, valid --days days. An existing DIR/ca.pem and ca.key are used
as they are, so certificates for a node added later come from the same CA.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from pathlib import Path
from typing import Any

from kvstore.admin import render


def _name(text: str) -> Any:
    from cryptography import x509
    try:
        return x509.IPAddress(ipaddress.ip_address(text))
    except ValueError:
        return x509.DNSName(text)


def _write(directory: Path, stem: str, key: Any, cert: Any) -> None:
    from cryptography.hazmat.primitives import serialization
    (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = directory / f"{stem}.key"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    os.chmod(key_path, 0o600)


def load_or_make_ca(directory: Path, days: int) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    if (directory / "ca.pem").exists() and (directory / "ca.key").exists():
        cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
        return cert, serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstore cluster CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    _write(directory, "ca", key, cert)
    return cert, key


def issue(directory: Path, ca: tuple[Any, Any], stem: str, common_name: str, names: list[str], days: int) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                              critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName([_name(n) for n in names]), critical=False)
    _write(directory, stem, key, builder.sign(ca_key, hashes.SHA256()))


def cmd_cluster_certs(node: Any, args: argparse.Namespace) -> None:
    directory = Path(args.directory)
    directory.mkdir(parents=True, exist_ok=True)
    nodes = [n for n in args.nodes.split(",") if n]
    extra = [n for n in args.node_names.split(",") if n]
    ca = load_or_make_ca(directory, args.days)
    issue(directory, ca, "etcd", "etcd", [n for n in args.etcd_names.split(",") if n], args.days)
    issue(directory, ca, "etcd-client", "kvstore", [], args.days)
    for node_id in nodes:
        issue(directory, ca, f"node-{node_id}", node_id, [node_id, *extra], args.days)
    render.emit(f"wrote the CA, etcd's, etcd clients' and {len(nodes)} nodes' certificates to {directory}")


def add_parser(actions: Any) -> None:
    certs = actions.add_parser("certs", help="a cluster's CA and the certificates of etcd, its clients and each node")
    certs.add_argument("directory")
    certs.add_argument("--nodes", required=True, help="node ids, comma-separated (cluster.node_id of each)")
    certs.add_argument("--node-names", default="", help="more names in every node's certificate (host names, IPs)")
    certs.add_argument("--etcd-names", default="localhost,127.0.0.1", help="etcd's host names and addresses")
    certs.add_argument("--days", type=int, default=365)
    certs.set_defaults(run=cmd_cluster_certs)
