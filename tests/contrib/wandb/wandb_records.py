"""Read an offline W&B run back: the records of its ``run-ID.wandb`` file.

wandb 0.2x dropped its Python reader (``wandb.sdk.internal.datastore``); the file is still
W&B's documented record log: a 7-byte header, then 32 KiB blocks of records, each with a
CRC-32, a length and a type (full, first, middle, last piece), holding one protobuf
``wandb.proto.wandb_internal_pb2.Record``. This reads it with wandb's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_FILE_HEADER = struct.Struct("<4sHB")  # ":W&B", magic, version
_RECORD_HEADER = struct.Struct("<IHB")  # checksum, length, type
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """Every ``Record`` of a ``.wandb`` file, in order; checksums verified."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, _magic, version = _FILE_HEADER.unpack_from(data)
    assert ident == b":W&B" and version == 0, f"{path} is not a W&B record log"
    out, pos, pending = [], _FILE_HEADER.size, b""
    while pos + _RECORD_HEADER.size <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _RECORD_HEADER.size:  # the block's tail is padding
            pos += room
            continue
        checksum, length, kind = _RECORD_HEADER.unpack_from(data, pos)
        if length == 0 and kind == 0:
            pos += room  # zero padding to the end of the block
            continue
        body = data[pos + _RECORD_HEADER.size:pos + _RECORD_HEADER.size + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum, \
            f"bad checksum at byte {pos} of {path}"
        pos += _RECORD_HEADER.size + length
        if kind == _FULL:
            whole = body
        elif kind == _FIRST:
            pending = body
            continue
        elif kind == _MIDDLE:
            pending += body
            continue
        else:
            whole, pending = pending + body, b""
        record = pb.Record()
        record.ParseFromString(whole)
        out.append(record)
    return out


@dataclass
class OfflineRun:
    """What one offline run folder holds, decoded."""

    folder: Path
    run_id: str = ""
    project: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    preempting: bool = False


def _value(item: Any) -> Any:
    return json.loads(item.value_json)


def _key(item: Any) -> str:
    return item.key or ".".join(item.nested_key)


def read_run(folder: Path) -> OfflineRun:
    """Decode the ``.wandb`` file of ``folder`` (an ``offline-run-*`` directory)."""
    (log,) = folder.glob("run-*.wandb")
    run = OfflineRun(folder)
    for record in records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.project = record.run.run_id, record.run.project
            run.name = record.run.display_name
            run.tags = list(record.run.tags)
            for item in record.run.config.update:
                run.config[_key(item)] = _value(item)
        elif kind == "config":
            for item in record.config.update:
                run.config[_key(item)] = _value(item)
        elif kind == "history":
            run.history.append({_key(i): _value(i) for i in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                run.summary[_key(item)] = _value(item)
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
        elif kind == "preempting":
            run.preempting = True
    # wandb keeps config values as {"value": v, "desc": ...}
    run.config = {k: v.get("value", v) if isinstance(v, dict) else v
                  for k, v in run.config.items()}
    return run


def offline_runs(run_dir: Path) -> list[OfflineRun]:
    """The offline runs under ``RUN_DIR/wandb``, oldest first (a resume adds one)."""
    return [read_run(f) for f in sorted((run_dir / "wandb").glob("offline-run-*"))]
