"""The compose file's `cluster` profile, checked without Docker: etcd and three nodes whose environment, read
with the image's config file, is a valid configuration naming the etcd service, each with its own id,
advertising the address of its interface on the compose network (no fixed name: the host could not resolve one),
reaching etcd over TLS with a client certificate and serving with a certificate of its own (and
`docker-compose --profile cluster config` accepts it)."""

import re
import subprocess
from pathlib import Path

import yaml

from system_tools import require_tool
from kvstore import config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
IMAGE_CONFIG = ROOT / "deploy" / "docker" / "kvstore.toml"


def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_cluster_profile_has_etcd_and_three_distinct_nodes():
    everything = services()
    cluster = {name: s for name, s in everything.items() if "cluster" in s.get("profiles", ())}
    assert "etcd" in cluster and "profiles" not in everything["kvstore"]   # a plain `up` starts one node only
    nodes = {name: s for name, s in cluster.items() if name != "etcd"}
    assert len(nodes) == 3
    ids, published = set(), set()
    for name, node in nodes.items():
        environ = {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in node["environment"].items()}
        settings = config.load(str(IMAGE_CONFIG), environ=environ)
        assert settings.cluster.endpoints == ("https://etcd:2379",)
        certs = [settings.cluster.etcd_tls_ca, settings.cluster.etcd_tls_cert, settings.cluster.etcd_tls_key,
                 settings.auth.tls_cert, settings.auth.tls_key]
        assert all(path.startswith("/certs/") for path in certs)                  # `kvstore cluster certs` wrote them
        assert settings.auth.tls_cert == f"/certs/node-{settings.cluster.node_id}.pem"   # its own, naming its id
        assert "./deploy/certs:/certs:ro" in node["volumes"]
        assert settings.cluster.advertise_host == settings.tcp.advertise_host == ""   # derived: the container's address
        for address in (settings.server.grpc_address, settings.tcp_address):
            assert address.startswith("0.0.0.0:")    # reachable from the other containers and the host
        ids.add(settings.cluster.node_id)
        published.update(node["ports"])
        assert node["depends_on"] == ["etcd"]
    assert len(ids) == 3 and len(published) == 3
    etcd = cluster["etcd"]["command"]
    assert "--client-cert-auth" in etcd and "https://0.0.0.0:2379" in etcd and "./deploy/certs:/certs:ro" in \
        cluster["etcd"]["volumes"]


def test_docker_compose_accepts_the_cluster_profile():
    compose = require_tool("docker-compose")
    result = subprocess.run([compose, "-f", str(COMPOSE), "--profile", "cluster", "config", "--quiet"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
