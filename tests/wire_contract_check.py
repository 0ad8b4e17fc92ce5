"""Run inside another environment: the SDK's wire contract and data paths under that environment's packages.

    python wire_contract_check.py [--address HOST:PORT] [--dtype float16]

Prints one JSON object: the versions of protobuf (and its implementation), numpy and grpcio it ran
with, `messages` (every message of kvstore.proto with every field set, serialized deterministically,
as hex: the caller compares them across runtimes), and with --address, `pages`: the checks of a page
put to and got from that node, over the local control channel and over gRPC.
Importing the wire contract must raise no warning: protobuf warns about gencode it will refuse next.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

PAGE_BYTES = 64 * 1024
PAGE_TOKENS = 16


def import_contract():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from kvstore_client.proto import kvstore_pb2
    return kvstore_pb2


def _repeated(field) -> bool:
    # FieldDescriptor.label is gone from protobuf 7; is_repeated came in 6.31.
    return field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED


def _value(field, depth: int):
    """A value of every field's type that a wrong wire type or width would not survive."""
    f = type(field)
    if field.type == f.TYPE_MESSAGE:
        return filled(field.message_type, depth + 1)
    if field.type == f.TYPE_ENUM:
        return field.enum_type.values[-1].number
    if field.type == f.TYPE_STRING:
        return f"{field.name}-é"
    if field.type == f.TYPE_BYTES:
        return bytes([0, 255]) + field.name.encode()
    if field.type == f.TYPE_BOOL:
        return True
    if field.type in (f.TYPE_DOUBLE, f.TYPE_FLOAT):
        return field.number + 0.5
    wide = field.type in (f.TYPE_UINT64, f.TYPE_FIXED64, f.TYPE_INT64, f.TYPE_SFIXED64, f.TYPE_SINT64)
    return (2**40 if wide else 2**20) + field.number


def filled(descriptor, depth: int = 0):
    """An instance of a message type with every field set (repeated fields twice), nested two deep."""
    from google.protobuf import message_factory

    message = message_factory.GetMessageClass(descriptor)()
    if depth > 2:
        return message
    for field in descriptor.fields:
        if _repeated(field) and field.message_type:
            getattr(message, field.name).extend([_value(field, depth), _value(field, depth)])
        elif _repeated(field):
            getattr(message, field.name).extend([_value(field, depth)] * 2)
        elif field.message_type:
            getattr(message, field.name).CopyFrom(_value(field, depth))
        else:
            setattr(message, field.name, _value(field, depth))
    return message


def message_bytes() -> dict[str, str]:
    pb = import_contract()
    out = {}
    for name, descriptor in sorted(pb.DESCRIPTOR.message_types_by_name.items()):
        message = filled(descriptor)
        cls = getattr(pb, name)
        assert type(message) is cls, f"{name}: GetMessageClass gave {type(message)}, the module has {cls}"
        data = message.SerializeToString(deterministic=True)
        assert cls.FromString(data) == message, f"{name} does not survive its own serialization"
        out[name] = data.hex()
    assert pb.ErrorCode.Name(pb.INVALID_ARGUMENT) == "INVALID_ARGUMENT" and pb.Tier.Value("NVME") == pb.NVME
    assert pb.DESCRIPTOR.services_by_name["KVStore"].methods_by_name["Reserve"].input_type.name == "ReserveRequest"
    return out


def page_round_trips(address: str, dtype: str) -> list[dict]:
    """Put a page, then get it back, over each control channel: the checks, each True when it held."""
    import numpy as np

    from kvstore_client import KVStoreClient, Namespace, prefix_hashes

    rng = np.random.default_rng(7)
    results = []
    for control in ("local", "grpc"):
        namespace = Namespace(model=f"wire-check-{control}", page_bytes=PAGE_BYTES, page_tokens=PAGE_TOKENS,
                              kv_dtype=dtype)
        tokens = rng.integers(0, 128_000, 2 * PAGE_TOKENS, dtype=np.int64)
        keys = prefix_hashes(tokens, PAGE_TOKENS)
        pages = rng.standard_normal((2, PAGE_BYTES // np.dtype(dtype).itemsize)).astype(dtype)
        out = np.zeros_like(pages)
        with KVStoreClient(address, timeout_s=10, control=control) as client:
            results.append({
                "control": control,
                "transport": client.transport,
                "keys_same_from_list": keys == prefix_hashes(tokens.tolist(), PAGE_TOKENS),
                "put": int(client.put(namespace, keys, pages)),
                "lookup_by_tokens": int(client.lookup(namespace, tokens=tokens.astype(np.uint32))),
                "got": int(client.get(namespace, keys, out, verify=True)),
                "same_bytes": out.tobytes() == pages.tobytes(),
            })
    return results


def versions() -> dict[str, str]:
    import google.protobuf
    import grpc
    import numpy
    from google.protobuf.internal import api_implementation

    return {"protobuf": google.protobuf.__version__, "protobuf_implementation": api_implementation.Type(),
            "numpy": numpy.__version__, "grpcio": grpc.__version__, "python": sys.version.split()[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address")
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args()
    report = {"versions": versions(), "messages": message_bytes()}
    if args.address:
        report["pages"] = page_round_trips(args.address, args.dtype)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
