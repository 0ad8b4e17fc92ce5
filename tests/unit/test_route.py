"""Route scoring: longest usable prefix per engine, each page weighted by the best place holding it."""

import pytest

from kvstore.control.engine_index import GPU, HOST
from kvstore.control.route import Weights, best_engine, check_engine_ids, score_engines
from kvstore_client import errors
from kvstore_client.proto import pb

W = Weights(engine_gpu=1.0, engine_host=0.8, dram=0.5, nvme=0.25)


def test_engine_gpu_beats_store_dram_for_the_same_prefix():
    scores = score_engines(["a", "b"], [pb.DRAM] * 3, {"a": [GPU, GPU, None, None]}, 4, W)
    assert [s.prefix_pages for s in scores] == [3, 3]
    assert scores[0].score == pytest.approx(2.5) and scores[0].engine_gpu_pages == 2 and scores[0].dram_pages == 1
    assert scores[1].score == pytest.approx(1.5) and scores[1].dram_pages == 3
    assert best_engine(scores) == "a"


def test_prefix_stops_at_the_first_page_nobody_holds():
    scores = score_engines(["a"], [pb.DRAM], {"a": [GPU, None, GPU]}, 3, W)
    assert scores[0].prefix_pages == 1 and scores[0].score == pytest.approx(1.0)


def test_store_pages_extend_an_engine_prefix_and_tiers_are_counted():
    scores = score_engines(["a"], [pb.DRAM, pb.NVME, pb.NVME], {"a": [HOST, GPU, None, None]}, 4, W)
    s = scores[0]
    assert (s.prefix_pages, s.engine_host_pages, s.engine_gpu_pages, s.nvme_pages) == (3, 1, 1, 1)
    assert s.score == pytest.approx(0.8 + 1.0 + 0.25)


def test_longer_store_prefix_can_outscore_a_short_gpu_prefix():
    scores = score_engines(["gpu", "store"], [pb.DRAM] * 0, {"gpu": [GPU, None, None, None]}, 4, W)
    assert best_engine(scores) == "gpu"
    scores = score_engines(["short", "long"], [], {"short": [GPU] + [None] * 3, "long": [HOST] * 4}, 4, W)
    assert best_engine(scores) == "long"


def test_ties_go_to_the_first_listed():
    scores = score_engines(["x", "y"], [pb.DRAM], {}, 1, W)
    assert best_engine(scores) == "x"


@pytest.mark.parametrize("ids, why", [([], "empty"), (["a", "a"], "twice"), ([""], "empty id"),
                                      (["e"] * 3, "twice")])
def test_bad_engine_lists_are_refused(ids, why):
    with pytest.raises(errors.InvalidArgument, match=why):
        check_engine_ids(ids, engines_max=8)


def test_too_many_engines_are_refused():
    with pytest.raises(errors.InvalidArgument, match="route.engines_max"):
        check_engine_ids([f"e{i}" for i in range(9)], engines_max=8)
