"""`kvstore`: inspect and operate a running kvstore node from a shell.

    kvstore status                      tiers, fill, hit rates, leases, health
    kvstore health                      exit 0 only while the node is SERVING
    kvstore namespaces                  what the node holds, per namespace
    kvstore lookup -n NS --tokens 1,2,3 leading pages cached (or --keys K ...)
    kvstore delete -n NS --keys K ...   remove pages and every page that extends them
    kvstore drain [--wait]              stop taking leases, finish open ones, exit
    kvstore bench                       quick put/get throughput against memcpy
    kvstore token --tenant T [--admin]  a new bearer token, and its line for auth.tokens_file
    kvstore cluster status etcd://H:2379/C  members of a cluster: state, weight, pages, bytes, load
    kvstore cluster certs DIR --nodes A,B   a cluster's CA and the certificates of etcd, clients, nodes

On a node with authentication the commands send KVSTORE_TOKEN (and KVSTORE_TLS_* files):
a tenant's token shows that tenant's namespaces only; scrub needs an admin's.

Tables for people; `--json` for scripts. Exit status: 0 done, 1 the node answered with
an error or cannot be reached, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import signal
import socket
import struct
import sys
import time
from typing import Any, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import __version__
from kvstore.admin import bench, cluster_status, render
from kvstore_client import errors
from kvstore_client.channel import GrpcChannel
from kvstore_client.credentials import Credentials
from kvstore_client.keys import encode_key
from kvstore_client.proto import pb

DEFAULT_TARGET = "127.0.0.1:50051"
KVSTORE_SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
_UCRED = struct.Struct("3i")  # pid, uid, gid


class UsageError(Exception):
    """The arguments cannot work; exit 2 with this message."""


class NotServing(Exception):
    """`kvstore health` found the node draining or unreachable; exit 1."""


class RemoteNode:
    """A running node as the commands see it: its control calls (gRPC) and its health."""

    def __init__(self, target: str, timeout_s: float):
        self.target = target
        self.timeout_s = timeout_s
        credentials = Credentials.resolve()
        self.control = GrpcChannel(target, timeout_s, credentials)
        self._channel = credentials.channel(target, [])
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def call(self, method: str, request: Any) -> Any:
        return self.control.call(method, request)

    def health(self) -> str:
        try:
            answer = self._health.Check(health_pb2.HealthCheckRequest(service=KVSTORE_SERVICE), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            return f"UNKNOWN ({exc.code().name})"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)

    def namespace(self, wanted: str) -> pb.NamespaceStats:
        """A namespace by id (hex, as `namespaces` prints it) or by model name, if one matches."""
        held = self.namespaces()
        text = wanted.lower().removeprefix("0x")
        by_id = [ns for ns in held if f"{ns.namespace_id:016x}" == text.rjust(16, "0")]
        matches = by_id or [ns for ns in held if ns.model == wanted]
        if len(matches) != 1:
            known = ", ".join(f"{ns.namespace_id:016x} ({ns.model})" for ns in held) or "none"
            why = "matches several namespaces" if matches else "is not open on this node"
            raise UsageError(f"namespace {wanted!r} {why}; open here: {known}")
        return matches[0]

    def namespaces(self) -> list[pb.NamespaceStats]:
        """Every namespace held, paging through Stats (one answer holds a bounded number)."""
        held: list[pb.NamespaceStats] = []
        while True:
            stats = self.call("Stats", pb.StatsRequest(namespaces_offset=len(held)))
            held += stats.namespaces
            if not stats.namespaces or len(held) >= stats.namespaces_total:
                return held

    def close(self) -> None:
        self.control.close()
        self._channel.close()


def cmd_status(node: RemoteNode, args: argparse.Namespace) -> None:
    hello = node.call("Hello", pb.HelloRequest(client_name="kvstore-cli"))
    stats = node.call("Stats", pb.StatsRequest())
    health = node.health()
    tiers = [_tier_dict(t) for t in stats.tiers]
    if args.json:
        render.emit_json({
            "target": node.target, "server_version": hello.server_version, "health": health,
            "shm_socket": hello.shm_socket, "arena_bytes": hello.arena_bytes, "tiers": tiers,
            "namespaces": stats.namespaces_total, **_scalars(stats),
            "nvme_quarantined": [{"shard": q.shard, "path": q.path, "moved_to": q.moved_to, "cause": q.cause,
                                  "at_start": q.at_start} for q in stats.nvme_quarantined]})
        return
    render.emit(f"kvstore {hello.server_version} at {node.target}  health {health}  "
                f"namespaces {stats.namespaces_total}  leases open {stats.leases_open}  "
                f"expired {stats.leases_expired}  pages committed {stats.pages_committed}  "
                f"checksum failures {stats.checksum_failures}")
    for shard in stats.nvme_quarantined:
        render.emit(f"NVMe shard {shard.shard} quarantined ({shard.path}): {shard.cause}; "
                    f"file moved to {shard.moved_to or '(not moved)'}")
    render.emit(render.table(
        ["TIER", "CAPACITY", "USED", "FILL", "PAGES", "HITS", "MISSES", "HIT RATE", "EVICTIONS", "PROMOTED",
         "DEMOTED"],
        [[t["tier"], render.human_bytes(t["capacity_bytes"]), render.human_bytes(t["used_bytes"]),
          render.percent(t["used_bytes"], t["capacity_bytes"]), t["pages"], t["hits"], t["misses"],
          render.percent(t["hits"], t["hits"] + t["misses"]), t["evictions"], t.get("promotions", "-"),
          t.get("demotions", "-")] for t in tiers]))


def cmd_health(node: RemoteNode, args: argparse.Namespace) -> None:
    health = node.health()
    if args.json:
        render.emit_json({"target": node.target, "health": health})
    else:
        render.emit(health)
    if health != "SERVING":
        raise NotServing(health)


def cmd_namespaces(node: RemoteNode, args: argparse.Namespace) -> None:
    held = node.namespaces()
    rows = [{"namespace_id": f"{ns.namespace_id:016x}", "model": ns.model, "tenant": ns.tenant,
             "page_bytes": ns.page_bytes, "pages": ns.pages, "bytes": ns.pages * ns.page_bytes} for ns in held]
    if args.json:
        render.emit_json(rows)
        return
    render.emit(render.table(
        ["ID", "MODEL", "TENANT", "PAGE", "PAGES", "BYTES"],
        [[r["namespace_id"], r["model"], r["tenant"] or "-", render.human_bytes(r["page_bytes"]), r["pages"],
          render.human_bytes(r["bytes"])] for r in rows]))


def cmd_scrub(node: RemoteNode, args: argparse.Namespace) -> None:
    """One scrub pass now: every DRAM and NVMe page re-read and checked against its checksum."""
    answer = node.control.call("Scrub", pb.ScrubRequest(), timeout_s=max(node.timeout_s, 3600.0))
    if args.json:
        render.emit_json({"pages_checked": answer.pages_checked, "pages_bad": answer.pages_bad})
    else:
        render.emit(f"scrub pass complete: pages checked {answer.pages_checked}, pages bad (dropped) "
                    f"{answer.pages_bad}")


def cmd_lookup(node: RemoteNode, args: argparse.Namespace) -> None:
    ns = node.namespace(args.namespace)
    request = pb.LookupRequest(namespace_id=ns.namespace_id)
    if args.tokens is not None:
        request.tokens.extend(_tokens(args.tokens))
        asked = f"{len(request.tokens)} tokens"  # the node cuts them into pages of its page_tokens
    else:
        request.keys.extend(_keys(args))
        asked = f"{len(request.keys)} keys"
    answer = node.call("Lookup", request)
    tiers = [pb.Tier.Name(t).lower() for t in answer.tiers]
    if args.json:
        render.emit_json({"namespace_id": f"{ns.namespace_id:016x}", "keys": len(request.keys),
                          "tokens": len(request.tokens), "hit_pages": answer.hit_pages, "tiers": tiers})
        return
    by_tier = {t: tiers.count(t) for t in dict.fromkeys(tiers)}
    where = ", ".join(f"{n} in {t}" for t, n in by_tier.items()) or "nothing cached"
    render.emit(f"{answer.hit_pages} leading pages cached for {asked} ({where})")


def cmd_delete(node: RemoteNode, args: argparse.Namespace) -> None:
    ns = node.namespace(args.namespace)
    answer = node.call("Delete", pb.DeleteRequest(namespace_id=ns.namespace_id, keys=_keys(args)))
    if args.json:
        render.emit_json({"namespace_id": f"{ns.namespace_id:016x}", "deleted_pages": answer.deleted_pages})
        return
    render.emit(f"deleted {answer.deleted_pages} pages (the given keys and every page extending them)")


def cmd_drain(node: RemoteNode, args: argparse.Namespace) -> None:
    """A drain is SIGTERM, the same path `systemctl stop` takes; the kernel checks who may send it."""
    pid = args.pid or _server_pid(node.call("Hello", pb.HelloRequest(client_name="kvstore-cli")).shm_socket)
    try:
        os.kill(pid, signal.SIGTERM)
    except PermissionError:
        raise UsageError(f"not allowed to signal kvstore-server pid {pid}: run as its user or root, "
                         "or use `systemctl stop kvstore`") from None
    except ProcessLookupError:
        raise UsageError(f"no process {pid}") from None
    health = _wait_until(lambda: node.health() != "SERVING", args.timeout) and node.health()
    stopped = args.wait and _wait_until(lambda: not _running(pid), args.timeout)
    if args.json:
        render.emit_json({"pid": pid, "health": health or "SERVING", "stopped": stopped})
        return
    after = "stopped" if stopped else "still running after --timeout" if args.wait else "open leases may finish"
    render.emit(f"draining kvstore-server pid {pid}: health {health or 'still SERVING'}; {after}")


def cmd_bench(node: RemoteNode, args: argparse.Namespace) -> None:
    hello = node.call("Hello", pb.HelloRequest(client_name="kvstore-bench"))
    result = bench.run(node.target, hello, args.pages, args.page_bytes, args.rounds, node.timeout_s)
    if args.json:
        render.emit_json(result)
        return
    render.emit(f"{result['pages']} pages of {render.human_bytes(result['page_bytes'])}, best of "
                f"{result['rounds']} rounds, same process as the memcpy reference")
    render.emit(render.table(["OP", "GB/S", "VS MEMCPY"], [
        ["memcpy", f"{result['memcpy_gbs']:.2f}", "1.00"],
        ["put", f"{result['put_gbs']:.2f}", f"{result['put_vs_memcpy']:.2f}"],
        ["get", f"{result['get_gbs']:.2f}", f"{result['get_vs_memcpy']:.2f}"]]))
    render.emit(f"lookup of {result['pages']} keys: median {result['lookup_us_median']:.0f} us, "
                f"max {result['lookup_us_max']:.0f} us over {result['lookups']} calls")


def _tier_dict(tier: pb.TierStats) -> dict[str, Any]:
    return {"tier": pb.Tier.Name(tier.tier).lower(), **_scalars(tier, skip=("tier",))}


def _scalars(message: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every scalar field, so fields a tier adds later show up in --json unasked."""
    return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields
            if not f.is_repeated and f.message_type is None and f.name not in skip}


def _tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise UsageError("--tokens takes token ids separated by commas or spaces") from None
    if not tokens or min(tokens) < 0 or max(tokens) > 0xFFFFFFFF:
        raise UsageError("--tokens needs at least one token id, each 0 to 2^32-1")
    return tokens


def _keys(args: argparse.Namespace) -> list[bytes]:
    if not args.keys:
        raise UsageError("give --keys (or --tokens for lookup)")
    try:
        return [bytes.fromhex(k) if args.hex else encode_key(k) for k in args.keys]
    except ValueError as exc:
        raise UsageError(f"bad key: {exc}") from None


def _server_pid(shm_socket: str) -> int:
    """The node's pid from the kernel (SO_PEERCRED on its Unix socket): no wire call can lie about it."""
    if not shm_socket:
        raise UsageError("the node has no shm socket to learn its pid from: pass --pid")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(shm_socket)
        pid, _, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError as exc:
        raise UsageError(f"cannot reach the node's socket {shm_socket} from here ({exc.strerror}): "
                         "run on the node's host, or pass --pid") from None
    finally:
        sock.close()
    if pid <= 0:
        raise UsageError("the node runs in another pid namespace: run inside it, or use `systemctl stop`")
    return pid


def _running(pid: int) -> bool:
    """True until the process has exited (an exited child its parent has not reaped yet counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="Inspect and operate a running kvstore node.")
    parser.add_argument("--target", "-t", default=DEFAULT_TARGET, help=f"node gRPC address (default {DEFAULT_TARGET})")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default 10)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("status", help="tiers, fill, hit rates, leases and health").set_defaults(run=cmd_status)
    commands.add_parser("health", help="SERVING (exit 0), or NOT_SERVING/unreachable (exit 1)").set_defaults(
        run=cmd_health)
    commands.add_parser("namespaces", help="namespaces held, with pages and bytes").set_defaults(run=cmd_namespaces)
    for name, run, text in (("lookup", cmd_lookup, "how many leading pages of a sequence are cached"),
                            ("delete", cmd_delete, "remove pages and every page that extends them")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--namespace", "-n", required=True, help="namespace id (see `namespaces`) or model name")
        sub.add_argument("--keys", nargs="+", metavar="KEY", help="prefix hashes in chain order")
        sub.add_argument("--hex", action="store_true", help="keys are hex of raw bytes, not text")
        if name == "lookup":
            sub.add_argument("--tokens", help="token ids (comma or space separated), hashed by the node")
        sub.set_defaults(run=run)
    commands.add_parser("scrub", help="re-read every page now and drop those whose bytes no longer match").set_defaults(
        run=cmd_scrub)
    drain = commands.add_parser("drain", help="stop taking leases, let open ones finish, then exit (SIGTERM)")
    drain.add_argument("--pid", type=int, help="server pid (default: learned from its shm socket)")
    drain.add_argument("--wait", action="store_true", help="wait until the server has exited")
    drain.set_defaults(run=cmd_drain)
    quick = commands.add_parser("bench", help="quick put/get throughput check against memcpy")
    quick.add_argument("--pages", type=int, default=64)
    quick.add_argument("--page-bytes", type=int, default=1 << 20)
    quick.add_argument("--rounds", type=int, default=3)
    quick.set_defaults(run=cmd_bench)
    token = commands.add_parser("token", help="a new bearer token (stdout line 1) and its auth.tokens_file line (2)")
    token.add_argument("--tenant", required=True)
    token.add_argument("--admin", action="store_true", help="the admin role (every tenant, scrub, metrics)")
    token.set_defaults(run=cmd_token)
    cluster_status.add_parser(commands)
    return parser


def cmd_token(node: RemoteNode, args: argparse.Namespace) -> None:
    """Only the digest goes in the node's file; the token itself is shown once, here."""
    if not args.tenant or any(c.isspace() or c == "#" for c in args.tenant):
        raise UsageError("--tenant must be a non-empty name without spaces or '#'")
    token = secrets.token_urlsafe(32)
    role = "admin" if args.admin else "tenant"
    sys.stdout.write(f"{token}\n{hashlib.sha256(token.encode()).hexdigest()} {args.tenant} {role}\n")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "lookup" and (args.tokens is None) == (not args.keys):
        parser.error("lookup takes --keys or --tokens (one of them)")
    node = RemoteNode(args.target, args.timeout)
    try:
        args.run(node, args)
    except UsageError as exc:
        sys.stderr.write(f"kvstore {args.command}: {exc}\n")
        return 2
    except errors.KVStoreError as exc:
        sys.stderr.write(f"kvstore {args.command}: {type(exc).__name__}: {exc}\n")
        return 1
    except NotServing:
        return 1
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
