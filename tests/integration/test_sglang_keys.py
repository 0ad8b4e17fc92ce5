"""kvstore's page keys are SGLang's own get_hash_str chain, byte for byte, wide token ids included.

SGLang 0.5.23 hashes in C++ (sglang/srt/mem_cache/cpp_utils/hash_binding.cpp, built on first use
with torch's JIT builder): that file is compiled here as it is, and get_hash_str is SGLang's own
function from its own source. Ids past uint32 (multimodal pad values are up to 62 bits) must key
the same pages here as there, by the C chain and the pure-Python one alike, and be refused only
where SGLang refuses them.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import shutil
import subprocess
import sysconfig
import typing
from pathlib import Path

import numpy as np
import pytest

from kvstore_client import errors
from kvstore_client.keys import Namespace, page_hash, prefix_hashes, prefix_hashes_packed, prefix_hashes_python
from sglang_harness import import_sglang

import_sglang()
from sglang.srt.mem_cache.cpp_utils import native_hash  # noqa: E402

NARROW = [1, 2, 3, 0xFFFFFFFF, 0, 70000]
PROMPTS = {
    "narrow": NARROW * 4,
    "one wide page": [*NARROW, 2**32, *NARROW[:5], *NARROW * 2],
    "mixed": [7, 2**40 + 5, 9, 2**62 - 1, 2**63 - 1, 0, *NARROW, 2**32, 2**32 + 1, *NARROW[:4], 5, 6, 2**33, 8, 9, 10],
    "all wide": [2**62 - 1 - i for i in range(24)],
}


@pytest.fixture(scope="module")
def sglang_get_hash_str(tmp_path_factory):
    """SGLang's get_hash_str over its own hash extension, compiled from its source."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ to build SGLang's hash extension")
    import torch

    source = Path(native_hash.__file__).with_name("hash_binding.cpp")
    out = tmp_path_factory.mktemp("sglang_hash") / ("hicache_hash_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([compiler, "-O1", "-std=c++17", "-shared", "-fPIC", "-DTORCH_EXTENSION_NAME=hicache_hash_cpp",
                    f"-I{Path(torch.__file__).parent / 'include'}", f"-I{sysconfig.get_paths()['include']}",
                    str(source), "-o", str(out), "-lcrypto"], check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location("hicache_hash_cpp", out)
    extension = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extension)
    # SGLang's loader goes through sglang.srt.utils, whose package import needs a GPU stack: the
    # extension it would build is handed over instead, and everything above it is SGLang's.
    loader = native_hash._load_native_hash_module
    native_hash._load_native_hash_module = lambda: extension
    utils = Path(native_hash.__file__).parents[1] / "utils.py"
    tree = ast.parse(utils.read_text(), filename=str(utils))
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_hash_str")
    namespace = {"get_native_hash": native_hash.get_native_hash, "List": list, "Optional": typing.Optional}
    exec(compile(ast.Module(body=[function], type_ignores=[]), str(utils), "exec"), namespace)
    yield namespace["get_hash_str"]
    native_hash._load_native_hash_module = loader


def sglang_chain(get_hash_str, tokens, page, seed=None):
    """SGLang's keys of every full page (it keys a trailing partial page too; kvstore does not)."""
    full = len(tokens) // page * page
    return get_hash_str(list(tokens[:full]), seed, page_size=page) if full else []


@pytest.mark.parametrize("name", PROMPTS)
@pytest.mark.parametrize("page", [1, 4, 6, 24])
def test_every_chain_is_sglangs_whatever_form_the_ids_come_in(sglang_get_hash_str, name, page):
    tokens = PROMPTS[name]
    seed = hashlib.sha256(b"salted").hexdigest()
    for prior in (None, seed):
        want = sglang_chain(sglang_get_hash_str, tokens, page, prior)
        assert len(want) == len(tokens) // page
        for form in (tokens, np.array(tokens, np.int64), np.array(tokens, np.uint64)):
            assert prefix_hashes(form, page, prior or "") == want, (name, type(form))
            assert prefix_hashes_python(form, page, prior or "") == want
            assert prefix_hashes_packed(form, page, prior or "") == "".join(want).encode()
        assert sglang_get_hash_str(tokens[:page], prior) == page_hash(tokens[:page], prior)


@pytest.mark.parametrize("ids", [[-1], [2**63], [5, 2**64]])
def test_ids_sglang_cannot_hash_are_refused_here_too(sglang_get_hash_str, ids):
    with pytest.raises((IndexError, OverflowError, ValueError)):
        sglang_get_hash_str(ids)
    for hash_them in (prefix_hashes, prefix_hashes_python, prefix_hashes_packed):
        with pytest.raises(errors.InvalidArgument, match="0 to 9223372036854775807"):
            hash_them(ids, 1)


def test_pages_put_by_wide_tokens_are_found_by_sglangs_keys(sglang_get_hash_str, client):
    """put, lookup and get by tokens key pages as SGLang does; Route by tokens, whose uint32 field
    cannot carry a wide id, refuses it before anything is sent and takes SGLang's keys instead."""
    tokens = PROMPTS["mixed"]
    ns = Namespace(model="wide", page_bytes=4096, page_tokens=6)
    pages = np.arange(4 * 4096, dtype=np.uint8).reshape(4, 4096) % 251
    assert client.put(ns, buffers=pages, tokens=np.array(tokens, np.int64)) == 4
    keys = sglang_chain(sglang_get_hash_str, tokens, 6)
    assert client.lookup(ns, keys=keys) == client.lookup(ns, tokens=tokens) == 4
    out = np.zeros_like(pages)
    assert client.get(ns, keys=keys, out=out) == 4 and np.array_equal(out, pages)
    with pytest.raises(errors.InvalidArgument, match="keys=prefix_hashes"):
        client.route(ns, ["engine-a"], tokens=tokens)
    assert client.route(ns, ["engine-a"], keys=keys).scores[0].prefix_pages == 4
