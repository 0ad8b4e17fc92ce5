"""Adapters to the engines' own plug-in points.

Each module here imports its engine when it is imported (it must subclass the engine's
base class), so `import kvstore_client` never pulls an engine in:

  kvstore_client.adapters.sglang   SGLang HiCache storage backend (KVStoreHiCacheStorage)
  kvstore_client.adapters.lmcache  LMCache remote storage plugin (KVStoreConnector)
  kvstore_client.adapters.vllm     vLLM tiering offload secondary tier (KVStoreSecondaryTier)
"""
