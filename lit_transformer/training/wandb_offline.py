"""One offline W&B folder per run, across resumes.

wandb (0.31) cannot resume an offline run: a resumed segment with the same run id writes a new
`wandb/offline-run-<time>-<id>/` folder (wandb issue #4624). `fold_segments` joins them after a
segment ends: the later segments' records are appended to the first folder's transaction log
as one continuous run (their `header` and `run` records dropped, the earlier `exit` dropped,
history steps renumbered to continue), their files moved in beside the first's, and their
folders removed, so `wandb sync` uploads one run with every step.

The transaction log (`run-<id>.wandb`) is LevelDB's log format after a 7-byte ':W&B' header:
32 KiB blocks of chunks, each with a 7-byte header (CRC-32 of the type byte and the data,
length, type: 1 full, 2 first, 3 middle, 4 last), blocks padded with zeros.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32768
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> tuple[bytes, list[bytes]]:
    """(file header, serialized records) of a transaction log."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B transaction log")
    records, pos, buffer = [], CHUNK_HEADER, b""
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left
            continue
        chunk, pos = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length], pos + CHUNK_HEADER + length
        buffer = chunk if kind in (FULL, FIRST) else buffer + chunk
        if kind in (FULL, LAST):
            records.append(buffer)
    return data[:CHUNK_HEADER], records


def _chunks(record: bytes, pos: int) -> Iterator[tuple[bytes, int]]:
    """(bytes to write, new position) for one record written at file position `pos`."""
    first = True
    while True:
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:
            yield b"\0" * left, pos + left
            pos += left
            continue
        room = left - CHUNK_HEADER
        piece, record = record[:room], record[room:]
        kind = (FULL if not record else FIRST) if first else (LAST if not record else MIDDLE)
        checksum = zlib.crc32(piece, zlib.crc32(bytes([kind])))
        out = struct.pack("<IHB", checksum, len(piece), kind) + piece
        yield out, pos + len(out)
        pos += len(out)
        first = False
        if not record:
            return


def write_records(path: Path, header: bytes, records: list[bytes]) -> None:
    parts, pos = [header], len(header)
    for record in records:
        for data, pos in _chunks(record, pos):
            parts.append(data)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(parts))
    tmp.replace(path)


def segments(wandb_dir: Path, run_id: str) -> list[Path]:
    """The offline folders of `run_id`, oldest first: their names start with the start time, and
    wandb adds "-1", "-2", ... to a folder started in the same second as an earlier one."""
    import re

    name = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    found = []
    for path in wandb_dir.glob(f"offline-run-*-{run_id}*"):
        match = name.fullmatch(path.name)
        if match and (path / f"run-{run_id}.wandb").is_file():
            found.append((match[1], int(match[2] or 0), path))
    return [path for _, _, path in sorted(found)]


def fold_segments(wandb_dir: Path, run_id: str, wait_s: float = 30.0) -> Path | None:
    """Join every offline folder of `run_id` into the oldest; returns it (None: nothing done).
    wandb's service writes a segment's log after `wandb.finish` returns, so the newest one is
    folded once its `exit` record is there (waiting up to `wait_s`)."""
    from wandb.proto import wandb_internal_pb2 as pb

    found = segments(wandb_dir, run_id)
    if len(found) < 2:
        return found[0] if found else None
    if not _ended(pb, found[-1] / f"run-{run_id}.wandb", wait_s):
        return None  # wandb's service is still writing the newest segment: fold after the next one
    first, later = found[0], found[1:]
    header, merged = read_records(first / f"run-{run_id}.wandb")
    for folder in later:
        merged = [r for r in merged if _kind(pb, r) != "exit"]  # the run goes on
        next_step = 1 + max((_step(pb, r) for r in merged), default=-1)
        for data in read_records(folder / f"run-{run_id}.wandb")[1]:
            kind = _kind(pb, data)
            if kind in ("header", "run"):
                continue  # the first segment's open the run
            if kind == "history":
                data = _shift_step(pb, data, next_step)
            merged.append(data)
    write_records(first / f"run-{run_id}.wandb", header, merged)
    for number, folder in enumerate(later, 1):
        for item in sorted(folder.rglob("*")):
            if item.is_file() and item.name != f"run-{run_id}.wandb":
                target = first / item.relative_to(folder)
                if target.parts[len(first.parts)] == "logs":  # keep every segment's debug logs
                    target = target.with_name(f"{target.stem}.{number}{target.suffix}")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(item), target)  # later files (summary, config, media) replace earlier ones
        shutil.rmtree(folder)
    for link in wandb_dir.iterdir():  # latest-run, debug.log: wandb's links to the newest folder
        if link.is_symlink() and not link.exists():
            link.unlink()
            link.symlink_to(first.name if link.name == "latest-run" else f"{first.name}/logs/{link.name}")
    return first


def wait_until_written(wandb_dir: Path, run_id: str, wait_s: float = 30.0) -> bool:
    """Whether the newest offline folder of `run_id` holds its whole log (its `exit` record),
    waiting up to `wait_s`: wandb's service writes it after `wandb.finish` returns, and a reader
    (fold_segments, `wandb sync`, a test) that comes first finds it cut mid-record. False at once
    for a run with no offline folder (online, or disabled)."""
    from wandb.proto import wandb_internal_pb2 as pb

    if not any(wandb_dir.glob(f"offline-run-*-{run_id}*")):
        return False
    deadline = time.monotonic() + wait_s
    while not (found := segments(wandb_dir, run_id)):  # the folder is there, its log not yet
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return _ended(pb, found[-1] / f"run-{run_id}.wandb", max(0.0, deadline - time.monotonic()))


def _ended(pb, log: Path, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if any(_kind(pb, data) == "exit" for data in read_records(log)[1]):
                return True
        except Exception:  # not written yet, or cut mid-record (protobuf's DecodeError)
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _kind(pb, data: bytes) -> str | None:
    record = pb.Record()
    record.ParseFromString(data)
    return record.WhichOneof("record_type")


def _step(pb, data: bytes) -> int:
    record = pb.Record()
    record.ParseFromString(data)
    return record.history.step.num if record.WhichOneof("record_type") == "history" else -1


def _shift_step(pb, data: bytes, offset: int) -> bytes:
    """A history record's step (and its `_step` item) moved on by `offset`."""
    record = pb.Record()
    record.ParseFromString(data)
    record.history.step.num += offset
    for item in record.history.item:
        if (item.key or "/".join(item.nested_key)) == "_step":
            item.value_json = json.dumps(json.loads(item.value_json) + offset)
    return record.SerializeToString()
