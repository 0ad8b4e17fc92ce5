"""The layout kernel's CUDA source compiles, and defines every kernel the SDK launches (needs nvcc, not a GPU)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstore_client import gpu_device

ROOT = Path(__file__).resolve().parents[2]


def test_the_sdk_ships_the_source_in_native():
    assert gpu_device.kernel_source() == (ROOT / "native" / "kv_layout.cu").read_text()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed: the kernel source is not compiled here")
def test_kernel_source_compiles_to_ptx_with_every_kernel(tmp_path):
    ptx = tmp_path / "kv_layout.ptx"
    subprocess.run(["nvcc", "--ptx", "-std=c++17", "-arch=sm_80", "-o", str(ptx), str(ROOT / "native" / "kv_layout.cu")],
                   check=True, capture_output=True, timeout=240)
    entries = set(re.findall(r"\.entry\s+(\w+)\(", ptx.read_text()))
    assert entries == set(gpu_device.KERNEL_NAMES)
