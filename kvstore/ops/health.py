"""The standard gRPC health service (grpc.health.v1) and, when enabled, server reflection.

Load balancers and `kvstore status` ask Health/Check. The node answers SERVING once it
serves and NOT_SERVING from the moment a drain starts, while it still finishes open
leases, so traffic moves away before the port closes.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.control.grpc_server import SERVICE_NAME

# "" is the whole server, as the health protocol defines it.
SERVICES = ("", SERVICE_NAME)


class HealthState:
    def __init__(self, server: grpc.Server, reflection_enabled: bool):
        self._servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        if reflection_enabled:
            reflection.enable_server_reflection(
                (*SERVICES[1:], health.SERVICE_NAME, reflection.SERVICE_NAME), server)

    def serving(self) -> None:
        self._set(health_pb2.HealthCheckResponse.SERVING)

    def draining(self) -> None:
        self._set(health_pb2.HealthCheckResponse.NOT_SERVING)

    def _set(self, status: int) -> None:
        for name in SERVICES:
            self._servicer.set(name, status)
