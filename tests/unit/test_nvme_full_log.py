"""A full NVMe tier makes room from several threads at once (the controller's and RPC threads writing
pages down): every eviction is counted and the log says so at most once a minute, never once per pass."""

import logging
import re
import sys
import threading
import time

import pytest
from node_parts import close_node, make_node
from test_node_core import NODE, SMALL, chain, open_ns, put

from kvstore.control import controller as controller_module

pytestmark = pytest.mark.usefixtures("index_kind")


class SlowSink(logging.Handler):
    """A log sink that takes a while per line (a busy journald or disk): threads run meanwhile."""

    def emit(self, record: logging.LogRecord) -> None:
        time.sleep(0.01)


def test_room_made_from_many_threads_is_logged_once_and_every_eviction_counted(tmp_path, caplog):
    svc = make_node(tmp_path, NODE)
    try:
        ns = open_ns(svc, SMALL)
        for c in range(16):
            put(svc, ns, chain(f"c{c}", 8), SMALL, durable=True)   # 128 pages on NVMe, over 2 shards
        assert svc.store.counters.nvme_evictions == 0
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)   # threads interleave as tightly as they can
        start = threading.Barrier(8)

        def make_room(shard):
            start.wait()
            for _ in range(20):
                svc.controller._make_room(shard, 1)

        caplog.set_level(logging.INFO, logger=controller_module.__name__)
        sink = SlowSink()
        logging.getLogger(controller_module.__name__).addHandler(sink)
        try:
            threads = [threading.Thread(target=make_room, args=(i % 2,)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            sys.setswitchinterval(switch)
            logging.getLogger(controller_module.__name__).removeHandler(sink)
        lines = [r.getMessage() for r in caplog.records if "NVMe full" in r.getMessage()]
        assert len(lines) == 1, lines
        evicted = svc.store.counters.nvme_evictions
        assert evicted > 0
        said = int(re.search(r"evicted pages=(\d+)", lines[0]).group(1))
        assert said + svc.controller._full_evicted == evicted   # no eviction lost between threads
    finally:
        close_node(svc)
