"""Mooncake Store's shared-memory path as a peer in the same run (bench/hot_path.py; never collected by pytest).

Mooncake's master and its real client bind every interface, so they run in this process's own
network namespace (private_network(), which needs root): loopback plus a veth pair, since its
transfer engine refuses to start without a non-loopback address. The benchmark process is the
dummy client: pages live in the mem pool it shares with the real client (Mooncake's zero-copy
path: register the pool, then batch_put_from / batch_get_into by address), and the real client
copies them into and out of its global segment (MC_STORE_MEMCPY=1: a local memcpy, not TCP).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time

CLONE_NEWNET = 0x40000000
MASTER_PORT, CLIENT_PORT, METADATA_PORT = 50051, 50052, 8080


def unavailable_reason() -> str:
    """Why the Mooncake peer cannot run here ("" when it can)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"mooncake-transfer-engine-non-cuda is not installed ({exc})"
    if os.geteuid() != 0:
        return "a private network namespace for Mooncake's servers needs root"
    if not shutil.which("ip"):
        return "the ip command (iproute2) is missing"
    return ""


def private_network() -> None:
    """Move this process (and the children it starts) into a new network namespace with lo and a veth pair."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
    for command in ("ip link set lo up", "ip link add mc0 type veth peer name mc1",
                    "ip addr add 10.99.0.1/24 dev mc0", "ip link set mc0 up", "ip link set mc1 up"):
        subprocess.run(command.split(), check=True)


class MooncakePeer:
    """A master, a real client holding `segment_bytes`, and this process as a dummy client with `pool_bytes`."""

    def __init__(self, segment_bytes: int, pool_bytes: int, cpus: str):
        from mooncake.store import MooncakeDistributedStore

        self._logs = tempfile.TemporaryDirectory(prefix="mooncake-bench-")
        bin_dir = os.path.dirname(sys.executable)
        pin = ["taskset", "-c", cpus]
        self._processes = [self._start(pin + [
            os.path.join(bin_dir, "mooncake_master"), "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={METADATA_PORT}",
            f"--rpc_port={MASTER_PORT}", "--default_kv_lease_ttl=50"], "master")]
        time.sleep(1.0)
        self._processes.append(self._start(pin + [
            os.path.join(bin_dir, "mooncake_client"), f"--global_segment_size={segment_bytes >> 20}MB",
            "--host=127.0.0.1", f"--port={CLIENT_PORT}", f"--master_server_address=127.0.0.1:{MASTER_PORT}",
            f"--metadata_server=http://127.0.0.1:{METADATA_PORT}/metadata", "--protocol=tcp"], "client"))
        self.store = MooncakeDistributedStore()
        deadline = time.monotonic() + 60
        while self.store.setup_dummy(pool_bytes, 0, f"127.0.0.1:{CLIENT_PORT}") != 0:
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"Mooncake's real client did not come up (logs in {self._logs.name})")
            time.sleep(1.0)

    def _start(self, command: list[str], name: str) -> subprocess.Popen:
        log = open(os.path.join(self._logs.name, f"{name}.log"), "wb")
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, MC_STORE_MEMCPY="1"))

    def pool_buffer(self, nbytes: int) -> int:
        """An address of nbytes in the shared mem pool, registered for zero-copy puts and gets."""
        address = self.store.alloc_from_mem_pool(nbytes)
        if not address or self.store.register_buffer(address, nbytes) != 0:
            raise RuntimeError(f"Mooncake could not give a registered pool buffer of {nbytes} bytes")
        return address

    def put(self, keys: list[str], addresses: list[int], page_bytes: int) -> int:
        """Pages stored (a code other than 0 is a page that was not)."""
        return sum(code == 0 for code in self.store.batch_put_from(keys, addresses, [page_bytes] * len(keys)))

    def get(self, keys: list[str], addresses: list[int], page_bytes: int) -> int:
        return sum(code == page_bytes for code in self.store.batch_get_into(keys, addresses, [page_bytes] * len(keys)))

    def remove(self, keys: list[str]) -> None:
        time.sleep(0.06)   # past the read lease (default_kv_lease_ttl above)
        self.store.batch_remove(keys)

    def stop(self) -> None:
        try:
            self.store.close()
        except Exception:  # noqa: BLE001 - the servers are stopped below either way
            pass
        for process in reversed(self._processes):
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        self._logs.cleanup()
