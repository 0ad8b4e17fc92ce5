"""GPU tests run where cupy sees a CUDA device; elsewhere each is skipped with the reason."""

from __future__ import annotations

import pytest


def cuda_missing() -> str:
    """Why GPU tests cannot run here, or "" when they can."""
    try:
        import cupy
    except ImportError:
        return "cupy is not installed (GPU tests need cupy and a CUDA device)"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "no CUDA device is visible"
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return f"no usable CUDA device: {exc}"
    return ""


def pytest_collection_modifyitems(config, items):
    reason = cuda_missing()
    for item in items:
        if reason and item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
