"""The node's store tests run against both page indexes: the C one and the Python reference."""

import pytest

import node_parts
from kvstore.control import native_index


@pytest.fixture(params=[pytest.param("true", id="native-index",
                                     marks=pytest.mark.skipif(not native_index.available(),
                                                              reason="kvstore_native is not built")),
                        pytest.param("false", id="python-index")])
def index_kind(request, monkeypatch):
    """Nodes made by node_parts in this test use this page index (server.native_index)."""
    monkeypatch.setattr(node_parts, "BASE_SETTINGS", [f"server.native_index={request.param}"])
    return request.param
