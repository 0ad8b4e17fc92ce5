"""kvstore-client: the thin SDK engines use to store and load KV pages in kvstore."""

from kvstore_client.async_client import AsyncKVStoreClient
from kvstore_client.buffers import page_buffer
from kvstore_client.client import KVStoreClient
from kvstore_client.cluster import KVStoreCluster
from kvstore_client.errors import InvalidArgument, KVStoreError
from kvstore_client.keys import Namespace, namespace_id, page_hash, prefix_hashes
from kvstore_client.pipeline import PutResult
from kvstore_client.shared_buffers import shared_page_buffer

__all__ = ["AsyncKVStoreClient", "InvalidArgument", "KVStoreClient", "KVStoreCluster", "KVStoreError", "Namespace",
           "PutResult", "namespace_id", "page_buffer", "page_hash", "prefix_hashes", "shared_page_buffer"]
