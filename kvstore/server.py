"""kvstore-server: the one module that wires the node together, and its `main`.

    kvstore-server --config kvstore.toml --set dram.arena_bytes=4GiB

Start-up either serves or exits non-zero with one line naming the problem. SIGTERM
(or SIGINT) drains: new leases are refused, open ones may finish until
server.drain_timeout_s, then the node stops and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

from kvstore import __version__, config as config_module
from kvstore.config import Config, ConfigError
from kvstore.control.event_subscriber import EventSubscriber
from kvstore.control.grpc_server import create_server
from kvstore.control import recovery
from kvstore.control.local_server import LocalServer
from kvstore.control.service import KVStoreService
from kvstore.tiers.dram import Arena
from kvstore.tiers.nvme import NvmeTier

log = logging.getLogger("kvstore.server")


class Node:
    """Everything one kvstore-server process runs, started and stopped in order."""

    def __init__(self, config: Config):
        self.config = config
        self.arena = Arena(config.dram.arena_bytes, config.dram.hugepages, config.dram.prefault)
        self.local: LocalServer | None = None
        self.nvme: NvmeTier | None = None
        try:
            if config.nvme.enabled:
                self.nvme = NvmeTier(config.nvme_paths, config.nvme.map_bytes, config.nvme.io_threads)
            socket_path = config.shm_socket_path if config.shm.enabled else ""
            self.service = KVStoreService(config, self.arena, shm_socket=socket_path, nvme=self.nvme)
            if self.nvme:
                report = recovery.rebuild(self.nvme, self.service.index, self.service.namespaces)
                self.service.counters.recovered_pages = report.pages
            if socket_path:
                self.local = LocalServer(socket_path, self.service, self.arena.fd, config.allowed_uids)
            self.grpc, self.grpc_port = create_server(self.service, config.server.grpc_address,
                                                      config.server.grpc_workers)
            self.subscribers = _subscribers(config, self.service)
        except BaseException:
            if self.local is not None:
                self.local.close()
            if self.nvme is not None:
                self.nvme.close()
            self.arena.close()
            raise
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="lease-reaper", daemon=True)

    @property
    def grpc_address(self) -> str:
        host = self.config.server.grpc_address.rsplit(":", 1)[0]
        return f"{host}:{self.grpc_port}"

    def start(self) -> None:
        self.grpc.start()
        if self.local is not None:
            self.local.start()
        if self.service.controller:
            self.service.controller.start()
        self._reaper.start()
        for subscriber in self.subscribers:
            subscriber.start()

    def drain_and_stop(self) -> None:
        deadline = time.monotonic() + self.config.server.drain_timeout_s
        self.service.start_draining()
        open_leases = self.service.open_leases()
        log.info("draining started open_leases=%d timeout_s=%.1f", open_leases, self.config.server.drain_timeout_s)
        while open_leases and time.monotonic() < deadline:
            time.sleep(0.05)
            open_leases = self.service.open_leases()
        self._stop.set()
        for subscriber in self.subscribers:
            subscriber.stop()
        self.grpc.stop(grace=1.0).wait()
        if self.local is not None:
            self.local.close()
        if self.service.controller:
            self.service.controller.stop()
        if self.nvme is not None:
            self.nvme.close()
        log.info("draining complete open_leases_left=%d", open_leases)

    def _reap_loop(self) -> None:
        interval = self.config.leases.reap_interval_ms / 1000
        while not self._stop.wait(interval):
            try:
                self.service.reap_expired()
            except Exception:  # the reaper must outlive a bug in one pass
                log.exception("lease reaping failed")


def _subscribers(config: Config, service: KVStoreService) -> list[EventSubscriber]:
    events = config.events
    replays = events.replay_endpoints or ("",) * len(events.endpoints)
    try:
        return [EventSubscriber(engine_id, endpoint, replay, events.topic, service.engines, events.replay_timeout_ms)
                for engine_id, endpoint, replay in zip(events.engine_ids, events.endpoints, replays)]
    except ImportError as exc:
        raise OSError(f"[events] needs pyzmq and msgspec ({exc}): pip install 'kvstore[events]'") from None


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvstore-server", description="kvstore node: a tiered KV-cache store.")
    parser.add_argument("--config", help="TOML configuration file")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one setting (repeatable); wins over the file and KVSTORE_* variables")
    parser.add_argument("--grpc-address", help="shortcut for --set server.grpc_address=...")
    parser.add_argument("--arena-bytes", help="shortcut for --set dram.arena_bytes=...")
    parser.add_argument("--shm-socket", help="shortcut for --set shm.socket_path=...")
    parser.add_argument("--ready-file", help="shortcut for --set server.ready_file=...")
    parser.add_argument("--version", action="version", version=f"kvstore-server {__version__}")
    return parser.parse_args(argv)


def _write_ready_file(path: str, node: Node) -> None:
    info = {"pid": os.getpid(), "grpc_address": node.grpc_address, "grpc_port": node.grpc_port,
            "shm_socket": node.local.path if node.local else ""}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)  # readers never see a half-written file


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    shortcuts = {"server.grpc_address": args.grpc_address, "dram.arena_bytes": args.arena_bytes,
                 "shm.socket_path": args.shm_socket, "server.ready_file": args.ready_file}
    overrides = [f"{k}={v}" for k, v in shortcuts.items() if v is not None] + args.set
    try:
        config = config_module.load(args.config, overrides=overrides)
    except ConfigError as exc:
        sys.stderr.write(f"kvstore-server: configuration error: {exc}\n")
        return 2
    logging.basicConfig(level=config.server.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    log.info("effective configuration %s", json.dumps(config_module.as_dict(config), sort_keys=True))
    try:
        node = Node(config)
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    node.start()
    if config.server.ready_file:
        _write_ready_file(config.server.ready_file, node)
    log.info("serving version=%s grpc=%s shm_socket=%s arena_bytes=%d", __version__, node.grpc_address,
             node.local.path if node.local else "-", config.dram.arena_bytes)
    while not stop.wait(1.0):
        pass
    node.drain_and_stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
