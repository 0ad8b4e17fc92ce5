"""A second, third-party LMCache remote storage plugin for test_lmcache_plugin.py: LMCache's blackhole
connector under another plugin name, loaded the way any out-of-tree connector class is."""

from lmcache.v1.storage_backend.connector.blackhole_connector import BlackholeConnector


class OtherConnector(BlackholeConnector):
    def __init__(self, loop, local_cpu_backend, config):
        super().__init__()
