"""The thin pyverbs layer (verbs.PyverbsVerbs) against a fake pyverbs with rdma-core's signatures: argument names, sq_sig_all=0, chains, closes, errors.

The fake copies only the constructors' and methods' signatures from rdma-core's pyverbs
sources (wr.pyx: SendWR(wr_id, opcode, num_sge, imm_data, sg, send_flags, next_wr) whose
send_flags default to SIGNALED and whose memory is freed only by close(); qp.pyx:
QPInitAttr(..., sq_sig_all=1); addr.pyx: GlobalRoute(dgid, flow_label, sgid_index, hop_limit,
traffic_class) with hop_limit 1 by default). It proves the layer calls them as written there,
not that a NIC accepts what it posts.
"""

import sys
import types

import pytest

from kvstore_client import verbs as v

E = types.SimpleNamespace(
    IBV_QPT_RC=2, IBV_QPS_INIT=1, IBV_QPS_RTR=2, IBV_QPS_RTS=3, IBV_QPS_ERR=6, IBV_QP_STATE=1,
    IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=2, IBV_ACCESS_REMOTE_READ=4, IBV_WR_RDMA_WRITE=0,
    IBV_WR_RDMA_READ=4, IBV_SEND_SIGNALED=2, IBV_PORT_ACTIVE=4)


class PyverbsError(Exception):
    pass


class PyverbsRDMAError(PyverbsError):
    def __init__(self, msg, error_code=-1):
        super().__init__(msg)
        self.error_code = error_code


class Closable:
    closes = 0

    def close(self):
        self.closes += 1


class SGE(Closable):
    def __init__(self, addr, length, lkey):
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR(Closable):
    def __init__(self, wr_id=0, opcode=E.IBV_WR_RDMA_WRITE, num_sge=0, imm_data=0, sg=None,
                 send_flags=E.IBV_SEND_SIGNALED, next_wr=None):
        assert num_sge == len(sg) >= 1
        self.wr_id, self.opcode, self.sg, self.send_flags, self.next_wr = wr_id, opcode, sg, send_flags, next_wr

    def set_wr_rdma(self, rkey, addr):
        self.rkey, self.remote_addr = rkey, addr


class QPCap:
    def __init__(self, max_send_wr=1, max_recv_wr=10, max_send_sge=1, max_recv_sge=1, max_inline_data=0):
        self.max_send_wr, self.max_send_sge = max_send_wr, max_send_sge


class QPInitAttr:
    def __init__(self, qp_type=4, qp_context=None, scq=None, rcq=None, srq=None, cap=None, sq_sig_all=1):
        self.qp_type, self.scq, self.cap, self.sq_sig_all = qp_type, scq, cap, sq_sig_all


class QPAttr:
    def __init__(self, qp_state=0, cur_qp_state=0, port_num=1, path_mtu=3, max_rd_atomic=1, max_dest_rd_atomic=0):
        self.qp_state = qp_state


class QP(Closable):
    posted: list = []

    def __init__(self, creator, init_attr, qp_attr=None):
        self.init_attr, self.qp_num, self.states = init_attr, 77, []
        self.fail = None

    def to_init(self, attr):
        self.states.append(("INIT", attr.qp_access_flags, attr.port_num))

    def to_rtr(self, attr):
        self.states.append(("RTR", attr.ah_attr, attr.dest_qp_num, attr.path_mtu, attr.max_dest_rd_atomic))

    def to_rts(self, attr):
        self.states.append(("RTS", attr.sq_psn, attr.max_rd_atomic))

    def modify(self, qp_attr, attr_mask):
        self.states.append(("MODIFY", qp_attr.qp_state, attr_mask))

    def post_send(self, send_wr, bad_wr=None):
        if self.fail:
            raise PyverbsRDMAError("Failed to post send", self.fail)
        chain = []
        while send_wr is not None:
            chain.append((send_wr.wr_id, send_wr.send_flags, send_wr.remote_addr, [(s.addr, s.length) for s in send_wr.sg]))
            send_wr = send_wr.next_wr
        QP.posted.append(chain)


class WC:
    def __init__(self, wr_id, status):
        self.wr_id, self.status = wr_id, status


class CQ(Closable):
    def __init__(self, creator, cqe, cq_context=None, channel=None, comp_vector=0):
        self.cqe = cqe

    def poll(self, num_entries=1):
        return 1, [WC(5, 0)]


class GlobalRoute:
    def __init__(self, dgid=None, flow_label=0, sgid_index=0, hop_limit=1, traffic_class=0):
        self.dgid, self.sgid_index, self.hop_limit, self.traffic_class = dgid, sgid_index, hop_limit, traffic_class


class AHAttr:
    def __init__(self, dlid=0, sl=0, src_path_bits=0, static_rate=0, is_global=0, port_num=1, gr=None):
        self.dlid, self.sl, self.is_global, self.port_num, self.gr = dlid, sl, is_global, port_num, gr


class GID:
    def __init__(self, val=None):
        self.gid = val


class Context(Closable):
    def __init__(self, name=None, **kwargs):
        if name != "mlx5_0":
            raise PyverbsRDMAError(f"Failed to open {name}", 19)
        self.name = name

    def query_device(self):
        return types.SimpleNamespace(max_qp_wr=32768, max_sge=30, max_qp_rd_atom=16, max_qp_init_rd_atom=16,
                                     max_cqe=4194303)

    def query_port(self, port_num):
        return types.SimpleNamespace(state=E.IBV_PORT_ACTIVE, lid=0, active_mtu=5, gid_tbl_len=2)

    def query_gid(self, port_num, index):
        return GID("0000:0000:0000:0000:0000:ffff:0a00:0001" if index else "fe80:0000:0000:0000:0000:0000:0000:0001")


class PD(Closable):
    def __init__(self, creator):
        pass


class MR(Closable):
    def __init__(self, creator, length, access, address=None, **kwargs):
        self.length, self.access, self.lkey, self.rkey = length, access, 11, 12


@pytest.fixture
def pyverbs(monkeypatch):
    package = types.ModuleType("pyverbs")
    modules = {
        "device": {"Context": Context, "get_device_list": lambda: [types.SimpleNamespace(name=b"mlx5_0")]},
        "pd": {"PD": PD}, "cq": {"CQ": CQ, "WC": WC}, "mr": {"MR": MR},
        "qp": {"QP": QP, "QPCap": QPCap, "QPInitAttr": QPInitAttr, "QPAttr": QPAttr},
        "wr": {"SGE": SGE, "SendWR": SendWR}, "addr": {"GlobalRoute": GlobalRoute, "AHAttr": AHAttr, "GID": GID},
        "enums": vars(E), "pyverbs_error": {"PyverbsError": PyverbsError, "PyverbsRDMAError": PyverbsRDMAError},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(f"pyverbs.{name}")
        module.__dict__.update(attrs)
        setattr(package, name, module)
        monkeypatch.setitem(sys.modules, f"pyverbs.{name}", module)
    monkeypatch.setitem(sys.modules, "pyverbs", package)
    QP.posted = []
    return package


def test_the_layer_calls_pyverbs_as_rdma_core_defines_it(pyverbs):
    verbs = v.PyverbsVerbs()
    assert verbs.device_names() == ["mlx5_0"]
    device = verbs.open("mlx5_0")
    assert device.limits.max_sge == 30
    port = device.port(1)
    assert port.active and [g.index for g in port.gids] == [0, 1] and port.gids[1].ipv4_mapped
    region = device.register(0x1000, 4096, remote=True)
    assert (region.lkey, region.rkey) == (11, 12)
    qp = device.create_queue_pair(256, 16, 256)
    assert qp.qp.init_attr.sq_sig_all == 0 and qp.qp.init_attr.qp_type == E.IBV_QPT_RC
    qp.connect(v.PeerAddress(0, bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 2]), 99, 7, 5),
               v.Route(1, 1, hop_limit=64, traffic_class=106, service_level=3), 5, 16, access_remote=False)
    rtr = qp.qp.states[1]
    ah = rtr[1]
    assert ah.is_global == 1 and ah.sl == 3 and ah.gr.hop_limit == 64 and ah.gr.traffic_class == 106
    assert ah.gr.sgid_index == 1 and ah.gr.dgid.gid == "0000:0000:0000:0000:0000:ffff:0a00:0002"
    requests = [v.WorkRequest(i, v.OP_WRITE, ((0x1000 + i, 8, 11), (0x2000 + i, 8, 11)), 0x9000 + i, 12, i == 2)
                for i in range(3)]
    qp.post_send(requests)
    assert QP.posted == [[(0, 0, 0x9000, [(0x1000, 8), (0x2000, 8)]), (1, 0, 0x9001, [(0x1001, 8), (0x2001, 8)]),
                          (2, E.IBV_SEND_SIGNALED, 0x9002, [(0x1002, 8), (0x2002, 8)])]]   # one chain, in order
    assert qp.poll(16) == [v.Completion(5, 0)]
    qp.to_error()
    assert qp.qp.states[-1] == ("MODIFY", E.IBV_QPS_ERR, E.IBV_QP_STATE)


def test_every_wr_object_is_closed_once_and_errors_are_verbs_errors(pyverbs, monkeypatch):
    made = []
    for cls in (SGE, SendWR):
        original = cls.__init__

        def init(self, *a, _original=original, **k):
            _original(self, *a, **k)
            made.append(self)
        monkeypatch.setattr(cls, "__init__", init)
    qp = v.PyverbsVerbs().open("mlx5_0").create_queue_pair(4, 2, 4)
    qp.qp.fail = 12
    with pytest.raises(v.VerbsError) as failure:
        qp.post_send([v.WorkRequest(1, v.OP_READ, ((0x1000, 8, 11),), 0x9000, 12, True)])
    assert failure.value.errno == 12
    assert len(made) == 2 and all(obj.closes == 1 for obj in made)
    with pytest.raises(v.VerbsError) as failure:
        v.PyverbsVerbs().open("mlx5_9")
    assert failure.value.errno == 19
