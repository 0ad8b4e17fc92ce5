"""One virtualenv per engine with that engine's own resolved dependencies plus the SDK, for test_engine_envs.py.

    python tests/engine_envs.py build [ENGINE ...]   # resolve and install the stale ones; print the table
    python tests/engine_envs.py show                 # the table: what each resolution chose, time, size

For each engine pip resolves `<engine>==<version> ./clients/python` the way a user's `pip install` would
(its own resolver and this machine's pip config; --dry-run --report), and a resolution that fails is a
failed build: that is the check that the SDK's pins fit the engine's. A fresh venv under
.venv-engines/<engine>/ then gets exactly the resolved set, --no-deps, except LEFT_OUT: the CUDA builds
of torch and the GPU kernels and libraries, which need a GPU to load and weigh gigabytes. torch 2.13.0+cpu
stands in for torch (one copy under .venv-engines/, on each venv's path through a .pth file). `pip check`
may then report requirements on LEFT_OUT packages only, and torch's version; anything else fails the
build. The SDK is installed editable from this checkout, so a change to its code needs no rebuild.

Each venv's stamp (.stamp.json) holds its inputs (engine, the SDK's requirements, LEFT_OUT, pip and its
config) and what the build found; a venv whose inputs are unchanged is kept, so a re-run takes seconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import venvs

VENVS = venvs.ROOT / ".venv-engines"
TORCH_DIR = VENVS / "torch-cpu"
CLIENT = venvs.ROOT / "clients" / "python"
ENGINES = {"sglang": "sglang==0.5.23", "vllm": "vllm==0.33.0", "lmcache": "lmcache==0.5.6"}
# The package each engine's adapter is written against, and the adapter module.
ADAPTERS = {"sglang": "kvstore_client.adapters.sglang", "vllm": "kvstore_client.adapters.vllm",
            "lmcache": "kvstore_client.adapters.lmcache"}
PIP = "pip==26.3"
# A local build (in /opt/wheels, on find-links in this machine's pip config): PyPI has no +cpu release, so
# this pin can never fetch a CUDA torch.
TORCH_CPU = "torch==2.13.0+cpu"
# What the resolution may not download whole: with fast-deps pip reads a wheel's metadata through HTTP range
# requests (this machine's index serves no PEP 658 metadata); a full download means that failed, and the
# next one could be a CUDA torch or a 700 MB cuDNN.
RESOLVE_DOWNLOAD_BYTES_MAX = 20 * 2**20
UNIT_BYTES = {"kB": 1e3, "MB": 1e6, "GB": 1e9}   # as pip prints sizes

_CUDA_LIBRARY = "CUDA toolkit library (shared objects that load only next to a CUDA driver)"
_GPU_KERNELS = "GPU kernels, or a compiler of GPU kernels; nothing in it runs on a CPU"
LEFT_OUT = {
    # The CUDA builds of torch; torch 2.13.0+cpu stands in for the engine's pin (sglang 2.14.1, vllm 2.14.0).
    "torch": "CUDA build (2.14.x, with the nvidia-* libraries below); TORCH_CPU stands in",
    "torchaudio": "CUDA build against the engine's torch: loads libc10_cuda.so, so it fails next to the CPU torch",
    "torchvision": "CUDA build against the engine's torch: its C++ ops do not register with the CPU torch",
    "torchcodec": "CUDA build against the engine's torch: loads libnvrtc.so.13",
    # The CUDA toolkit torch and the kernels pull in (about 3 GB).
    **dict.fromkeys([
        "cuda-toolkit", "nvidia-cublas", "nvidia-cuda-cccl", "nvidia-cuda-crt", "nvidia-cuda-cupti",
        "nvidia-cuda-nvcc", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cudnn-cu13", "nvidia-cudnn-frontend",
        "nvidia-cufft", "nvidia-cufile", "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse",
        "nvidia-cusparselt-cu13", "nvidia-mathdx", "nvidia-nccl-cu13", "nvidia-nvjitlink", "nvidia-nvshmem-cu13",
        "nvidia-nvtx", "nvidia-nvvm"], _CUDA_LIBRARY),
    **dict.fromkeys(["cuda-bindings", "cuda-core", "cuda-python"], "CUDA driver and runtime bindings"),
    **dict.fromkeys([
        "triton", "tokenspeed-triton", "flashinfer-python", "flash-attn-4", "humming-kernels", "quack-kernels",
        "sglang-kernel", "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla", "tilelang", "tokenspeed-mla", "cuda-tile",
        "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
        "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13", "cupy-cuda13x"], _GPU_KERNELS),
    **dict.fromkeys(["nccl4py", "nccl-extensions", "nvshmem4py-cu13"], "GPU-to-GPU communication (NCCL, NVSHMEM)"),
    "pynvvideocodec": "NVIDIA's hardware video decoder",
}
# Packages whose names look like GPU packages but that load and work on a CPU: installed.
KEPT = {
    "cuda-pathfinder": "pure Python: finds CUDA libraries when asked",
    "nvidia-ml-py": "pure Python NVML bindings; the engines ask it for GPUs and handle none",
    "nvtx": "annotation ranges, no-ops without NVIDIA's tools",
    "torch-memory-saver": "imports with the CPU torch; hooks CUDA allocations only when used",
    "torch-c-dlpack-ext": "imports with the CPU torch",
    "kernels": "pure Python: the Hugging Face kernel hub client",
    "kernels-data": "pure Python data of the kernel hub client",
}
GPU_LOOKING = re.compile(r"^(nvidia-|cuda-|torch)|cu1[0-9]|kernel|triton|flash|cupy|nccl|nvshmem|cutlass|mla$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def inputs(engine: str) -> dict:
    """What an engine's venv is built from: a change to any of these makes it stale."""
    client = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]["dependencies"]
    pip_config = venvs.run([sys.executable, "-m", "pip", "config", "list"]).stdout.splitlines()
    return {"engine": ENGINES[engine], "client_requires": client, "left_out": sorted(LEFT_OUT), "pip": PIP,
            "torch": TORCH_CPU, "pip_config": pip_config, "python": sys.version.split()[0]}


def resolve(venv: Path) -> list[dict]:
    """The distributions pip chooses for the engine plus the SDK (the report's "install" list)."""
    engine = ENGINES[venv.name]
    report = venv / "resolution.json"
    argv = [str(venvs.python(venv)), "-m", "pip", "install", "--disable-pip-version-check", "--dry-run",
            "--ignore-installed", "--use-feature=fast-deps", "--report", str(report), engine, str(CLIENT)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PIP_PROGRESS_BAR": "off"})
    lines = []
    for line in process.stdout:
        lines.append(line)
        download = re.search(r"Downloading (\S+) \(([\d.]+) (kB|MB|GB)\)", line)
        if download and float(download[2]) * UNIT_BYTES[download[3]] > RESOLVE_DOWNLOAD_BYTES_MAX:
            process.kill()
            process.wait()
            raise RuntimeError(f"resolving {engine}: pip began a full download of {download[1]} ({download[2]} "
                               f"{download[3]}); stopped it (see RESOLVE_DOWNLOAD_BYTES_MAX)")
    if process.wait() != 0:
        raise RuntimeError(f"pip cannot install {engine} and kvstore-client together:\n{''.join(lines[-60:])}")
    return json.loads(report.read_text())["install"]


def classify(resolved: list[dict]) -> tuple[list[str], list[str]]:
    """(pins to install, LEFT_OUT names the resolution holds); refuses a GPU-looking name in neither table."""
    pins, left_out = [], []
    for item in resolved:
        name, version = canonical(item["metadata"]["name"]), item["metadata"]["version"]
        if name == "kvstore-client":
            continue
        if name in LEFT_OUT:
            left_out.append(name)
        elif GPU_LOOKING.search(name) and name not in KEPT:
            raise RuntimeError(f"{name}=={version} looks like a GPU package: add it to LEFT_OUT or KEPT, with why")
        else:
            pins.append(f"{name}=={version}")
    return sorted(pins), sorted(left_out)


def unexplained_pip_check(venv: Path) -> list[str]:
    """Lines of `pip check` other than requirements on LEFT_OUT packages and on torch's version."""
    done = subprocess.run([str(venvs.python(venv)), "-m", "pip", "check"], capture_output=True, text=True)
    unexplained = []
    for line in done.stdout.splitlines():
        missing = re.match(r"^\S+ \S+ requires (\S+?),? which is not installed\.$", line)
        torch_version = re.match(r"^\S+ \S+ has requirement torch\W.*, but you have torch \S+\.$", line)
        if not (missing and canonical(missing[1]) in LEFT_OUT) and not torch_version:
            unexplained.append(line)
    return unexplained


def shared_torch() -> Path:
    """TORCH_CPU installed once, for every engine venv's path."""
    marker = TORCH_DIR / f".{TORCH_CPU}"
    if not marker.exists():
        shutil.rmtree(TORCH_DIR, ignore_errors=True)
        venvs.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--quiet", "--no-deps",
                   "--target", str(TORCH_DIR), TORCH_CPU])
        marker.touch()
    return TORCH_DIR


def build_steps(venv: Path) -> dict:
    timings = {}
    started = time.monotonic()
    venvs.pip(venv, "install", "--quiet", PIP)
    resolved = resolve(venv)
    timings["resolve_s"] = round(time.monotonic() - started, 1)
    pins, left_out = classify(resolved)
    started = time.monotonic()
    venvs.pip(venv, "install", "--quiet", "--no-deps", *pins)
    (venvs.site_packages(venv) / "kvstore_torch_cpu.pth").write_text(f"{shared_torch()}\n")
    venvs.pip(venv, "install", "--quiet", "--no-deps", "-e", str(CLIENT))
    timings["install_s"] = round(time.monotonic() - started, 1)
    unexplained = unexplained_pip_check(venv)
    if unexplained:
        raise RuntimeError(f"pip check in {venv.name}: requirements unmet beyond LEFT_OUT:\n" + "\n".join(unexplained))
    chosen = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in resolved}
    return {"resolved": {name: chosen.get(name) for name in ("protobuf", "numpy", "grpcio", "xxhash", "torch")},
            "installed": len(pins), "left_out": left_out, **timings}


def stamp(engine: str) -> dict | None:
    """The engine venv's stamp when it is current, else None."""
    return venvs.current(VENVS / engine, inputs(engine))


def table(stamps: dict[str, dict | None]) -> str:
    rows = [f"{'engine':8} {'protobuf':9} {'numpy':7} {'grpcio':7} {'xxhash':6} {'pkgs':>4} {'left out':>8} "
            f"{'build s':>7} {'MiB':>5}"]
    for engine, s in stamps.items():
        if s is None:
            rows.append(f"{engine:8} (not built or stale: python tests/engine_envs.py build {engine})")
            continue
        r = s["resolved"]
        rows.append(f"{engine:8} {r['protobuf']:9} {r['numpy']:7} {r['grpcio']:7} {r['xxhash']:6} "
                    f"{s['installed']:>4} {len(s['left_out']):>8} {s['build_s']:>7} {s['bytes'] >> 20:>5}")
    if TORCH_DIR.exists():
        rows.append(f"(MiB without {TORCH_CPU}, one copy for all: {venvs.tree_bytes(TORCH_DIR) >> 20} MiB)")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    command, names = (argv[0] if argv else "show"), argv[1:] or list(ENGINES)
    unknown = [n for n in names if n not in ENGINES]
    if command not in ("build", "show") or unknown:
        print(f"usage: engine_envs.py build|show [{'|'.join(ENGINES)} ...]", file=sys.stderr)
        return 2
    stamps = {}
    for engine in names:
        if command == "build":
            started = time.monotonic()
            stamps[engine] = venvs.build(VENVS / engine, inputs(engine), build_steps)
            print(f"{engine}: ready in {time.monotonic() - started:.1f} s", flush=True)
        else:
            stamps[engine] = stamp(engine)
    print(table(stamps))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
