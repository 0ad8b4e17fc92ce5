"""kvstore-client: the thin SDK engines use to store and load KV pages in kvstore."""

from kvstore_client.client import KVStoreClient
from kvstore_client.errors import KVStoreError
from kvstore_client.keys import Namespace, namespace_id, page_hash, prefix_hashes

__all__ = ["KVStoreClient", "KVStoreError", "Namespace", "namespace_id", "page_hash", "prefix_hashes"]
