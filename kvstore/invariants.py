"""A broken invariant stops the node: it is logged loudly and the process exits at once.

An AssertionError inside the store, the controller, the reaper or a carrier means a page's
state is impossible; serving on from it could hand out wrong bytes. The node exits with
EXIT_INVARIANT_BROKEN and its supervisor (systemd's Restart=, the watchdog) starts a clean
one, which rebuilds from NVMe. Carriers call `stop_node` instead of answering INTERNAL.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

log = logging.getLogger(__name__)

EXIT_INVARIANT_BROKEN = 70  # EX_SOFTWARE


def stop_node(where: str, exc: BaseException) -> NoReturn:
    log.critical("invariant broken in %s: stopping the node", where, exc_info=exc)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(EXIT_INVARIANT_BROKEN)
