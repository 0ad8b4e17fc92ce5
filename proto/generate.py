"""Generate the Python modules of the wire contract from proto/kvstore/v1/*.proto.

    python proto/generate.py            # rewrite the checked-in modules
    python proto/generate.py --check    # exit 1 when they drift from the .proto

The modules land flat in clients/python/kvstore_client/proto/ so that importing
them never collides with the server package, which is also called `kvstore`.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "clients" / "python" / "kvstore_client" / "proto"
SOURCES = ["kvstore/v1/kvstore.proto"]
GENERATED = ["kvstore_pb2.py", "kvstore_pb2.pyi"]


def generate(out_dir: pathlib.Path) -> None:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={tmp}", f"--pyi_out={tmp}", *SOURCES]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        for name in GENERATED:
            out_dir.joinpath(name).write_bytes(pathlib.Path(tmp, "kvstore", "v1", name).read_bytes())


def drifted() -> list[str]:
    """Names of checked-in modules that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(pathlib.Path(tmp))
        return [
            name for name in GENERATED
            if pathlib.Path(tmp, name).read_bytes() != OUT_DIR.joinpath(name).read_bytes()
        ]


if __name__ == "__main__":
    if "--check" in sys.argv:
        stale = drifted()
        if stale:
            raise SystemExit(f"generated modules drifted from the .proto: {stale}; run python proto/generate.py")
    else:
        generate(OUT_DIR)
