"""The systemd notification protocol (sd_notify(3)): datagrams of KEY=value lines.

systemd passes the socket in NOTIFY_SOCKET (a path, or "@name" for an abstract socket)
and, with WatchdogSec=, the interval in WATCHDOG_USEC; config.py reads both into
[systemd]. Without a socket every call is a no-op, so the daemon runs the same way
under systemd, in a container or in a test.
"""

from __future__ import annotations

import logging
import os
import socket

from kvstore.config import SystemdConfig

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, settings: SystemdConfig):
        self.address = _socket_address(settings.notify_socket)
        # WATCHDOG_PID names the process systemd watches; a child that inherited it is not.
        watched = not settings.watchdog_pid or settings.watchdog_pid == os.getpid()
        self.watchdog_usec = settings.watchdog_usec if watched else 0
        self._sock: socket.socket | None = None
        self._failed = False
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    @property
    def watchdog_interval_s(self) -> float:
        """How often to send WATCHDOG=1: half the interval, as sd_watchdog_enabled(3) advises; 0 = never."""
        return self.watchdog_usec / 2e6

    def send(self, *lines: str) -> bool:
        """One datagram of `lines`; False (logged) when systemd cannot be reached."""
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(lines).encode(), self.address)
        except OSError as exc:
            if not self._failed:  # once: the watchdog would repeat it every few seconds
                log.warning("systemd notification failed socket=%r error=%r", self.address, exc.strerror)
            self._failed = True
            return False
        if self._failed:
            log.info("systemd notifications delivered again")
            self._failed = False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _socket_address(notify_socket: str) -> str | bytes:
    if notify_socket.startswith("@"):
        return b"\0" + notify_socket[1:].encode()  # abstract namespace
    if notify_socket and not notify_socket.startswith("/"):
        log.warning("systemd notifications off: unsupported NOTIFY_SOCKET %r (a path or @name)", notify_socket)
        return ""
    return notify_socket
