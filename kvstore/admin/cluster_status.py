"""`kvstore cluster status etcd://host:2379/<cluster>`: every member etcd lists, with what it holds.

Members come from etcd (their state, endpoints and placement weight, ramp included); pages,
bytes and load (hits + misses served) from each node's Stats over gRPC. A member that does
not answer is listed with "-" for what only it can tell. On nodes with authentication it sends
KVSTORE_TOKEN (and KVSTORE_TLS_* files), as every command does; pages and bytes are whole tiers,
so an admin's token shows them.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvstore.admin import cluster_certs, render


def cmd_cluster_status(node: Any, args: argparse.Namespace) -> None:
    from kvstore_client.cluster import KVStoreCluster   # needs aetcd: kvstore[cluster]
    from kvstore_client.placement import weight

    with KVStoreCluster(args.url, timeout_s=args.timeout, transport="tcp") as cluster:
        members = cluster.members()
        stats = cluster.node_stats()
        etcd_lost = cluster.etcd_lost
    now = time.time()
    rows = []
    for m in members:
        answer = stats.get(m.node_id)
        tiers = list(answer.tiers) if answer is not None else []
        full = weight(m, now + 10 * max(m.ramp_s, 1.0))
        rows.append({"node_id": m.node_id, "state": m.state, "host_id": m.host_id[:12], "grpc": m.grpc_address,
                     "tcp": m.tcp_endpoint, "weight_percent": round(100 * weight(m, now) / full) if full else 0,
                     "capacity_bytes": m.capacity_bytes, "answers": answer is not None,
                     "pages": sum(t.pages for t in tiers) if answer is not None else None,
                     "used_bytes": sum(t.used_bytes for t in tiers) if answer is not None else None,
                     "load": sum(t.hits + t.misses for t in tiers) if answer is not None else None})
    if args.json:
        render.emit_json({"cluster": args.url, "etcd_reachable": not etcd_lost, "members": rows})
        return
    render.emit(f"cluster {args.url}  members {len(rows)}  serving {sum(r['state'] == 'serving' for r in rows)}"
                f"{'  etcd UNREACHABLE: members as last seen' if etcd_lost else ''}")

    def shown(value: Any, as_bytes: bool = False) -> str:
        if value is None:
            return "-"
        return render.human_bytes(value) if as_bytes else str(value)

    render.emit(render.table(
        ["NODE", "STATE", "GRPC", "TCP", "WEIGHT", "CAPACITY", "PAGES", "USED", "LOAD"],
        [[r["node_id"], r["state"], r["grpc"], r["tcp"], f"{r['weight_percent']}%",
          render.human_bytes(r["capacity_bytes"]), shown(r["pages"]), shown(r["used_bytes"], True), shown(r["load"])]
         for r in rows]))


def add_parser(commands: Any) -> None:
    cluster = commands.add_parser("cluster", help="a cluster of nodes on etcd")
    actions = cluster.add_subparsers(dest="cluster_command", required=True)
    status = actions.add_parser("status", help="members, state, weight, pages, bytes and load")
    status.add_argument("url", help="etcd://host:2379[,host:2379]/<cluster>")
    status.set_defaults(run=cmd_cluster_status)
    cluster_certs.add_parser(actions)
