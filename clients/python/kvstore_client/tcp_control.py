"""Control calls on a connection of their own to the node's TCP data plane (tcp_framing.Op.CALL).

A client that moves pages over TCP sends its Reserves, Commits, Acquires and Releases here, where the
node's Hello says it takes them (tcp_calls): the same kvstore.v1 messages as gRPC, answered in order,
so they pipeline as on the local channel (channel.OrderedChannel), each costing tens of microseconds
where a gRPC call from Python costs the better part of a millisecond on both ends. The connection
opens as the data connection does (TLS, congestion control, its HELLO with the data ticket), and the
node ends the leases its calls opened when it closes.
"""

from __future__ import annotations

import ssl

from kvstore_client import errors
from kvstore_client.channel import OrderedChannel
from kvstore_client.tcp_framing import (RESPONSE, Op, decode_call_answer, decode_response, encode_call,
                                        encode_hello)
from kvstore_client.tcp_transport import connect


class TcpControlChannel(OrderedChannel):
    def __init__(self, endpoint: str, timeout_s: float, congestion: str = "", ticket: bytes = b"",
                 tls: ssl.SSLContext | None = None):
        """As TcpDataPath: `ticket` is Hello's data_ticket (the connection's HELLO), `tls` the node's TLS context."""
        sock = connect(endpoint, timeout_s, congestion, tls)
        sock.settimeout(timeout_s)
        super().__init__(sock, timeout_s, f"TCP call connection to {endpoint}")
        self.endpoint = endpoint
        try:
            if ticket:
                self._hello(ticket)
        except BaseException:
            sock.close()
            raise

    def _hello(self, ticket: bytes) -> None:
        self._sock.sendall(encode_hello(ticket))
        status, op, length, _ = decode_response(self._recv_exact(RESPONSE.size))
        text = self._recv_exact(length)
        if status:
            raise errors.error_from_code(status, text.decode(errors="replace"))
        if op != Op.HELLO or length:
            raise errors.Internal(f"the {self._what} answered its HELLO with op {op} and {length} bytes")

    def _frame(self, method_id: int, payload: bytes) -> bytes:
        return encode_call(method_id, payload)

    def _answer_frame(self) -> tuple[int, bytes]:
        status, length = decode_call_answer(self._recv_exact(RESPONSE.size))
        return status, self._recv_exact(length)

    def _readable_before(self, deadline: float) -> bool:
        # Under TLS, bytes OpenSSL has already read and decrypted do not show in poll(2).
        return (isinstance(self._sock, ssl.SSLSocket) and self._sock.pending() > 0) or super()._readable_before(deadline)
