"""The Grafana dashboard reads metrics a real node exports: every kvstore_* and process_* name
in its queries appears in a scrape after traffic."""

import json
import re
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvstore_client import KVStoreClient, Namespace
from kvstore_client.proto import pb

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvstore.json"


def queries(dashboard):
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


def exported_names(server):
    return {sample.name for family in text_string_to_metric_families(server.metrics_text()) for sample in family.samples}


def test_every_query_reads_an_exported_metric(server):
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    with KVStoreClient(server.address) as client:  # traffic, including one error, so every series exists
        ns = Namespace(model="dash", page_bytes=8192)
        client.put(ns, ["a"], np.zeros((1, 8192), np.uint8))
        client.get(ns, ["a"], np.zeros((1, 8192), np.uint8))
        try:
            client._local.call("Release", pb.ReleaseRequest(lease_ids=[7]))
        except Exception:
            pass
    exported = exported_names(server)
    used = set()
    for title, expr in queries(dashboard):
        names = set(re.findall(r"\b(?:kvstore|process)_[a-z_]+\b", expr))
        assert names, f"panel {title!r} reads no kvstore metric"
        used |= names
    for name in sorted(used):
        assert name in exported, f"the dashboard reads {name}, which the node does not export"
    assert {"kvstore_tier_used_bytes", "kvstore_rpc_duration_seconds_bucket", "kvstore_dataplane_bytes_total",
            "kvstore_namespace_bytes", "kvstore_leases_open", "kvstore_tier_promotions_total",
            "kvstore_tier_demotions_total"} <= used
