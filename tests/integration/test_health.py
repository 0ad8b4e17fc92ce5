"""grpc.health.v1 on a real node: SERVING once up, NOT_SERVING for the whole drain while open
leases finish; server reflection is off unless ops.reflection enables it."""

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvstore_client import KVStoreClient, Namespace
from kvstore_client.proto import pb

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def check(address, service=""):
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_serving_for_the_server_and_the_kvstore_service(server):
    assert check(server.address) == SERVING
    assert check(server.address, "kvstore.v1.KVStore") == SERVING
    with pytest.raises(grpc.RpcError) as info:
        check(server.address, "no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_not_serving_while_draining(start_server):
    server = start_server({"server.drain_timeout_s": 20})
    with KVStoreClient(server.address, control="grpc") as client:
        ns_id = client._namespace_id(Namespace(model="m", page_bytes=8192))
        lease = client._grpc.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[b"a"], page_bytes=8192))
        with grpc.insecure_channel(server.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=20)
            assert next(watch).status == SERVING
            server.process.send_signal(signal.SIGTERM)
            assert next(watch).status == NOT_SERVING
            for _ in range(5):  # stays NOT_SERVING while the lease is open and the node still answers
                time.sleep(0.1)
                assert server.process.poll() is None
                assert stub.Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"),
                                  timeout=5).status == NOT_SERVING
            watch.cancel()
        client._grpc.call("Commit", pb.CommitRequest(lease_id=lease.lease_id))
    assert server.process.wait(10) == 0


def test_reflection_is_off_by_default(server):
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            ProtoReflectionDescriptorDatabase(channel).get_services()
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_reflection_lists_the_services_when_enabled(start_server):
    server = start_server({"ops.reflection": "true"})
    with grpc.insecure_channel(server.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = database.get_services()
        assert {"kvstore.v1.KVStore", "grpc.health.v1.Health"} <= set(services)
        assert database.FindFileContainingSymbol("kvstore.v1.KVStore").name == "kvstore/v1/kvstore.proto"
