"""A broken invariant stops the node with exit 70: stop_node itself, and each carrier (local channel, gRPC,
TCP data plane) when what it calls raises AssertionError, instead of answering INTERNAL and serving on."""

import subprocess
import sys
import textwrap

import pytest

from kvstore.invariants import EXIT_INVARIANT_BROKEN

BROKEN = '''
import logging, os, socket, sys
logging.basicConfig(level=logging.INFO)


class BrokenService:
    """Stands in for a service whose page state has become impossible: every request trips an assertion."""

    def handle(self, name, request, owner=None):
        raise AssertionError("page both free and leased")

    def end_owner(self, owner):
        pass


class BrokenResolver:
    def resolve_write(self, lease_id, token, slot, nbytes):
        raise AssertionError("page both free and leased")

    resolve_read = resolve_write

    def finish_transfer(self, grant):
        pass

    cut_transfer = finish_transfer
'''

CARRIERS = {
    "the local channel": '''
        from kvstore.control.local_server import LocalServer
        from kvstore_client import framing
        path = os.path.join(sys.argv[1], "kvstore.sock")
        server = LocalServer(path, BrokenService(), None, frozenset({os.getuid()}), connections_max=4)
        server.start()
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(20)
        sock.connect(path)
        sock.sendall(framing.encode(framing.METHOD_IDS["Hello"], b""))
        print("answered", sock.recv(4096))  # reached only if the node carried on
    ''',
    "the gRPC carrier": '''
        from kvstore.control.grpc_server import create_server
        from kvstore_client.channel import GrpcChannel
        from kvstore_client.proto import pb
        server, port = create_server(BrokenService(), "127.0.0.1:0", 2)
        server.start()
        GrpcChannel(f"127.0.0.1:{port}", 20).call("Hello", pb.HelloRequest())
        print("answered")
    ''',
    "the TCP data plane": '''
        from kvstore.transport.tcp import TcpServer, TcpSettings
        from kvstore_client import tcp_framing
        settings = TcpSettings(host="127.0.0.1", port=0, body_bytes_max=1 << 20, connections_max=4, idle_timeout_s=60,
                               write_buffer_high_bytes=1 << 20, write_buffer_low_bytes=1 << 16)
        server = TcpServer(settings, BrokenResolver())
        server.start()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        sock.sendall(tcp_framing.encode_request(tcp_framing.Op.GET, 1, bytes(tcp_framing.TOKEN_BYTES), 0, 4096))
        print("answered", sock.recv(4096))
    ''',
}


def run(script, *args):
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60)


def test_stop_node_logs_where_and_exits_70():
    result = run(BROKEN + textwrap.dedent('''
        from kvstore.invariants import stop_node
        try:
            assert False, "page both free and leased"
        except AssertionError as exc:
            stop_node("the test", exc)
        print("carried on")
    '''))
    assert result.returncode == EXIT_INVARIANT_BROKEN == 70, result.stderr
    assert "CRITICAL" in result.stderr and "invariant broken in the test: stopping the node" in result.stderr
    assert "page both free and leased" in result.stderr  # the traceback is in the log
    assert "carried on" not in result.stdout


@pytest.mark.parametrize("where", list(CARRIERS))
def test_a_carrier_stops_the_node_on_a_broken_invariant(where, tmp_path):
    result = run(BROKEN + textwrap.dedent(CARRIERS[where]), str(tmp_path))
    assert result.returncode == EXIT_INVARIANT_BROKEN, (result.stdout, result.stderr)
    assert f"invariant broken in {where}: stopping the node" in result.stderr
    assert "answered" not in result.stdout
