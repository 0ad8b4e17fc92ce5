"""The container deployment, checked without Docker: docker-compose.yml parses (and passes
`docker-compose config` where installed), keeps host IPC, a named volume for the NVMe tier
and the metrics port; the image's entry point is the `kvstore-server` console script, and
that script, run here with the image's own config file, serves and answers health checks."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import tomllib
import yaml

from system_tools import require_tool
from kvstore import config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
IMAGE_CONFIG = ROOT / "deploy" / "docker" / "kvstore.toml"
BIN = Path(sys.executable).parent


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def instruction(name: str) -> list[str]:
    return [args for op, args in dockerfile() if op == name]


def node_service() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]["kvstore"]


def compose_environment() -> dict[str, str]:
    """The service's environment with ${VAR:-default} resolved to its default."""
    return {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in node_service()["environment"].items()}


def test_compose_file_shape():
    document = yaml.safe_load(COMPOSE.read_text())
    node = document["services"]["kvstore"]
    assert node["ipc"] == "host"
    assert node["ulimits"]["memlock"] == -1
    assert (ROOT / node["build"]["context"] / node["build"]["dockerfile"]).resolve() == DOCKERFILE
    named = [v.split(":") for v in node["volumes"] if isinstance(v, str)]
    assert ["kvstore-nvme", "/var/lib/kvstore/nvme"] in named and "kvstore-nvme" in document["volumes"]
    settings = config.load(str(IMAGE_CONFIG), environ=compose_environment())
    published = {p.rsplit(":", 1)[1]: p for p in node["ports"]}
    for address in (settings.server.grpc_address, settings.ops.metrics_address, settings.tcp_address):
        port = address.rsplit(":", 1)[1]
        assert published[port] == f"127.0.0.1:{port}:{port}", "published on the host's loopback only"
    assert settings.tcp.advertise_host == "127.0.0.1", "host clients dial the published data plane"
    assert float(node["stop_grace_period"].rstrip("s")) > settings.server.drain_timeout_s
    assert settings.nvme.enabled and settings.nvme.paths == ("/var/lib/kvstore/nvme",), "the NVMe tier is on the volume"
    binds = [v for v in node["volumes"] if isinstance(v, dict)]
    assert binds[0]["target"] == str(Path(settings.shm.socket_path).parent)


def test_docker_compose_config_accepts_it():
    compose = require_tool("docker-compose")
    result = subprocess.run([compose, "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    broken = COMPOSE.with_name(".compose-check.yml")
    try:
        broken.write_text(COMPOSE.read_text().replace("ipc: host", "ipc: host\n    ipcx: host"))
        bad = subprocess.run([compose, "-f", str(broken), "config", "--quiet"], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
    finally:
        broken.unlink()
    assert bad.returncode != 0 and "ipcx" in bad.stderr


def test_image_runs_the_console_scripts_the_tests_run():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    [entrypoint] = instruction("ENTRYPOINT")
    assert json.loads(entrypoint) == ["kvstore-server"] and scripts["kvstore-server"] == "kvstore.server:main"
    [healthcheck] = instruction("HEALTHCHECK")
    command = json.loads(healthcheck.split("CMD", 1)[1])
    assert command[0] == "kvstore" and scripts["kvstore"] == "kvstore.admin.cli:main" and command[-1] == "health"
    exposed = {int(p) for args in instruction("EXPOSE") for p in args.split()}
    settings = config.load(str(IMAGE_CONFIG), environ={})
    assert exposed == {int(settings.server.grpc_address.rsplit(":", 1)[1]),
                       int(settings.ops.metrics_address.rsplit(":", 1)[1])}
    assert any("deploy/docker/kvstore.toml /etc/kvstore/kvstore.toml" in a for a in instruction("COPY"))
    for args in instruction("COPY"):
        if args.startswith("--from="):   # from the build stage, not the checkout
            continue
        for source in args.split()[:-1]:
            assert (ROOT / source).exists(), f"COPY source {source} is missing"


def test_image_installs_the_native_core():
    """The build stage makes a wheel of native/, the image installs it and imports it (the node logs index=c)."""
    [wheels] = [args for args in instruction("RUN") if args.startswith("pip wheel")]
    assert "./native" in wheels.split()
    [install] = [args for args in instruction("RUN") if args.startswith("pip install")]
    assert "kvstore-native" in install.split() and 'python -c "import kvstore_native"' in install


def test_entry_point_serves_with_the_image_config(tmp_path):
    ready = tmp_path / "ready.json"
    # The image's config, with what a test host cannot give it: fixed ports, /run, /var/lib, a 4 GiB arena.
    process = subprocess.Popen(
        [str(BIN / "kvstore-server"), "--config", str(IMAGE_CONFIG), "--grpc-address", "127.0.0.1:0",
         "--set", "ops.metrics_address=127.0.0.1:0", "--shm-socket", str(tmp_path / "kvstore.sock"),
         "--arena-bytes", "64MiB", "--ready-file", str(ready), "--set", f"nvme.paths={tmp_path / 'nvme-0'}",
         "--set", "nvme.map_bytes=64MiB"],
        stderr=subprocess.PIPE, env={k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")})
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read().decode()
            time.sleep(0.05)
        target = json.loads(ready.read_text())["grpc_address"]
        health = subprocess.run([str(BIN / "kvstore"), "--target", target, "--timeout", "3", "health"],
                                capture_output=True, text=True, timeout=30)
        assert health.returncode == 0 and health.stdout.strip() == "SERVING"
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        first = process.stderr.readline()
        assert json.loads(first)["msg"].startswith("effective configuration"), "the image logs JSON"
    finally:
        process.kill()
        process.wait()


def test_compose_variables_are_the_settings_own():
    """A variable exported for compose means the same to a kvstore-server started in that shell: no collision."""
    document = yaml.safe_load(COMPOSE.read_text())
    nodes = [service for service in document["services"].values() if "environment" in service]
    pairs = [(name, value) for node in nodes for name, value in node["environment"].items()]
    interpolated = [(name, re.findall(r"\$\{(\w+)", str(value))) for name, value in pairs]
    assert any(used for _, used in interpolated)
    for name, used in interpolated:
        assert used in ([], [name]), f"{name} takes ${{{used}}}: name the variable after the setting"
