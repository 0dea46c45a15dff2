"""Descriptor snapshot of infermesh.v1, and the compatibility check against it.

Regenerate after an additive change (new fields, messages, enum values, RPCs):
    .venv/bin/python -m tests.contract.wire_snapshot --write
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from google.protobuf.descriptor import Descriptor, EnumDescriptor, FileDescriptor

from infermesh.v1 import admin_pb2, common_pb2, gateway_pb2, scheduler_pb2

SNAPSHOT_PATH = Path(__file__).with_name("infermesh_v1_snapshot.json")
FILES: tuple[FileDescriptor, ...] = (
    common_pb2.DESCRIPTOR, gateway_pb2.DESCRIPTOR, scheduler_pb2.DESCRIPTOR, admin_pb2.DESCRIPTOR,
)


def _message(desc: Descriptor, out: dict) -> None:
    out["messages"][desc.full_name] = {
        "fields": {
            f.name: {"number": f.number, "type": f.type, "type_name": _type_name(f), "repeated": _is_repeated(f),
                     "oneof": f.containing_oneof.name if f.containing_oneof else None}
            for f in desc.fields
        },
        "reserved_numbers": sorted(n for start, end in _reserved_ranges(desc) for n in range(start, end)),
    }
    for nested in desc.nested_types:
        if not nested.GetOptions().map_entry:
            _message(nested, out)
    for enum in desc.enum_types:
        _enum(enum, out)


def _is_repeated(field) -> bool:
    return bool(field.is_repeated)


def _type_name(field) -> str | None:
    if field.message_type is not None:
        return field.message_type.full_name
    if field.enum_type is not None:
        return field.enum_type.full_name
    return None


def _reserved_ranges(desc: Descriptor) -> list[tuple[int, int]]:
    from google.protobuf import descriptor_pb2

    proto = descriptor_pb2.DescriptorProto()
    desc.CopyToProto(proto)
    return [(r.start, r.end) for r in proto.reserved_range]


def _enum(desc: EnumDescriptor, out: dict) -> None:
    out["enums"][desc.full_name] = {v.name: v.number for v in desc.values}


def snapshot() -> dict:
    out: dict = {"messages": {}, "enums": {}, "services": {}}
    for file in FILES:
        for message in file.message_types_by_name.values():
            _message(message, out)
        for enum in file.enum_types_by_name.values():
            _enum(enum, out)
        for service in file.services_by_name.values():
            out["services"][service.full_name] = {
                m.name: {"input": m.input_type.full_name, "output": m.output_type.full_name,
                         "client_streaming": m.client_streaming, "server_streaming": m.server_streaming}
                for m in service.methods
            }
    return out


def incompatibilities(old: dict, new: dict) -> list[str]:
    """What would break a peer built from `old` when talking to one built from `new`."""
    problems = []
    for name, message in old["messages"].items():
        now = new["messages"].get(name)
        if now is None:
            problems.append(f"message {name} was removed")
            continue
        by_number = {f["number"]: (fname, f) for fname, f in now["fields"].items()}
        for fname, field in message["fields"].items():
            current = now["fields"].get(fname)
            if current is None:
                if field["number"] in by_number:
                    problems.append(f"{name}.{fname}: number {field['number']} now belongs to "
                                    f"{by_number[field['number']][0]}")
                elif field["number"] not in now["reserved_numbers"]:
                    problems.append(f"{name}.{fname} (= {field['number']}) was removed without reserving its number")
                continue
            for key in ("number", "type", "type_name", "repeated"):
                if current[key] != field[key]:
                    problems.append(f"{name}.{fname}: {key} changed from {field[key]} to {current[key]}")
    for name, values in old["enums"].items():
        now = new["enums"].get(name)
        if now is None:
            problems.append(f"enum {name} was removed")
            continue
        for value, number in values.items():
            if value in now and now[value] != number:
                problems.append(f"{name}.{value}: number changed from {number} to {now[value]}")
            elif value not in now:
                problems.append(f"{name}.{value} (= {number}) was removed")
    for name, methods in old["services"].items():
        now = new["services"].get(name, {})
        for method, shape in methods.items():
            if method not in now:
                problems.append(f"rpc {name}.{method} was removed")
            elif now[method] != shape:
                problems.append(f"rpc {name}.{method} changed from {shape} to {now[method]}")
    return problems


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        SNAPSHOT_PATH.write_text(json.dumps(snapshot(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {SNAPSHOT_PATH}")
    else:
        print(__doc__)
