"""Generated wire contract (from proto/kvstore/v1/kvstore.proto). Do not edit by hand."""

from kvstore_client.proto import kvstore_pb2 as pb

__all__ = ["pb"]
