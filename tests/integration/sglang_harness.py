"""SGLang's own storage code on a CPU-only machine: what the HiCache tests import and build.

- `import_sglang()` imports the pinned sglang wheel's modules without running the top-level
  `sglang/__init__.py`, which loads the front-end language API and the HF-transformers
  patches (transformers, triton, PIL, ...: none of which the storage path uses).
  `sglang.srt` and `sglang.srt.mem_cache` have no __init__ of their own, so what runs is
  exactly hicache_storage.py and storage/backend_factory.py from the wheel.

- `SGLangHostPool` is a host KV pool that cannot be told from SGLang's MHATokenToKVPoolHost
  by the storage backend: a CPU tensor shaped as that class's init_kv_buffer shapes it,
  with the class's own get_page_buffer_meta, get_data_page, get_dummy_flat_data_page and
  set_from_flat_data_page, compiled from the installed wheel's pool_host/mha.py. The class
  itself cannot be built here: its module imports the CUDA kernel packages (sgl_kernel,
  tvm_ffi) and its constructor takes the device pool's buffers (MHABufferInfo) and pins
  its memory with cudaHostRegister. Those parts need a GPU; the pointer arithmetic the
  backend depends on does not.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from pathlib import Path

import torch

SGLANG_VERSION = "0.5.23"
HOST_POOL_METHODS = ("get_page_buffer_meta", "get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page")


def import_sglang() -> types.ModuleType:
    """Make `sglang` importable as a bare package (its submodules load from the real wheel)."""
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"sglang=={SGLANG_VERSION} is not installed: run make test (it installs "
                              "tests/requirements-engines.txt)")
        package = types.ModuleType("sglang")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        package.__file__ = spec.origin
        sys.modules["sglang"] = package
    from importlib.metadata import version

    installed = version("sglang")
    assert installed == SGLANG_VERSION, f"tests are pinned to sglang {SGLANG_VERSION}, found {installed}"
    return sys.modules["sglang"]


def _sglang_methods(module_file: Path, class_name: str, names: tuple[str, ...]) -> dict[str, object]:
    """Functions defined in a class of an SGLang source file, compiled from that file."""
    tree = ast.parse(module_file.read_text(), filename=str(module_file))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {m.name for m in methods}
    assert not missing, f"{class_name} in {module_file} has no {sorted(missing)}"
    namespace: dict[str, object] = {"torch": torch}
    exec(compile(ast.Module(body=methods, type_ignores=[]), str(module_file), "exec"), namespace)
    return {name: namespace[name] for name in names}


def _mha_host_pool_methods() -> dict[str, object]:
    import_sglang()
    spec = importlib.util.find_spec("sglang.srt.mem_cache.pool_host")
    return _sglang_methods(Path(spec.submodule_search_locations[0]) / "mha.py", "MHATokenToKVPoolHost",
                           HOST_POOL_METHODS)


class SGLangHostPool:
    """A CPU MHA host pool with SGLang's layouts and SGLang's own page methods (see module doc)."""

    def __init__(self, layout: str, pages: int, page_size: int = 16, layer_num: int = 4, head_num: int = 2,
                 head_dim: int = 32, dtype: torch.dtype = torch.bfloat16):
        self.layout, self.page_size, self.layer_num = layout, page_size, layer_num
        self.head_num, self.head_dim, self.dtype = head_num, head_dim, dtype
        self.page_num, self.size = pages, pages * page_size
        self.device, self.pin_memory = "cpu", False
        dims = {
            "layer_first": (2, layer_num, self.size, head_num, head_dim),
            "page_first": (2, self.size, layer_num, head_num, head_dim),
            "page_first_direct": (2, pages, layer_num, page_size, head_num, head_dim),
        }[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def fill_random(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=generator).to(self.dtype))

    def page_bytes(self, first_token: int) -> bytes:
        """SGLang's flat data page at a host index, as bytes."""
        return self.get_data_page(first_token, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


for _name, _method in _mha_host_pool_methods().items():
    setattr(SGLangHostPool, _name, _method)


MAMBA_POOL_METHODS = ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page", "get_page_buffer_meta",
                      "_iter_page_tensors", "_flatten_tensor_bytes", "get_size_per_token")


class SGLangMambaPool:
    """A CPU Mamba state host pool (page_first, one state slot per page) with SGLang's own page methods,
    compiled from the wheel's pool_host/mamba.py. MambaPoolHost itself cannot be imported here: its
    module pulls sglang.srt.configs, which needs torchvision, and it pins memory through CUDA."""

    def __init__(self, slots: int, layers: int = 2, temporal_shape=(4, 8), conv_shapes=((3, 16),),
                 temporal_dtype: torch.dtype = torch.float32, conv_dtype: torch.dtype = torch.bfloat16):
        self.layout, self.page_size, self.size = "page_first", 1, slots
        self.device, self.pin_memory = "cpu", False
        self.num_mamba_layers = layers
        self.temporal_dtype, self.conv_dtype, self.dtype = temporal_dtype, conv_dtype, conv_dtype
        self.temporal_state_shape = torch.Size(temporal_shape)
        self.conv_state_shapes = [torch.Size(shape) for shape in conv_shapes]
        self.temporal_state_elem_size = int(torch.Size(temporal_shape).numel())
        self.conv_state_elem_sizes = [int(torch.Size(shape).numel()) for shape in conv_shapes]
        self.slot_state_device_tensors, self.slot_state_buffers = [], []
        self.temporal_buffer = torch.zeros((slots, layers, 1, *temporal_shape), dtype=temporal_dtype)
        self.conv_buffer = [torch.zeros((slots, layers, 1, *shape), dtype=conv_dtype) for shape in conv_shapes]
        self.size_per_token = self.get_size_per_token()

    def fill_random(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for tensor in (self.temporal_buffer, *self.conv_buffer):
            tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))

    def page_bytes(self, slot: int) -> bytes:
        return self.get_data_page(slot, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def _mamba_host_pool_methods() -> dict[str, object]:
    import_sglang()
    spec = importlib.util.find_spec("sglang.srt.mem_cache.pool_host")
    return _sglang_methods(Path(spec.submodule_search_locations[0]) / "mamba.py", "MambaPoolHost",
                           MAMBA_POOL_METHODS)


for _name, _method in _mamba_host_pool_methods().items():
    setattr(SGLangMambaPool, _name, _method)
