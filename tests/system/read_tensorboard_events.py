#!/usr/bin/python3
"""An independent reader of Lockstep's TensorBoard event files.

Compiles proto/tensorboard.proto with `protoc --python_out`, reads the TFRecord
framing itself (checking both masked CRC32C checksums of every record with its own
CRC32C), decodes each Event, and compares every (task, step, metric, value) with
metrics.jsonl from the same run. Exits non-zero with a message on any difference.

Usage: read_tensorboard_events.py SOURCE_DIR OUTPUT_DIR
"""
import glob
import importlib
import json
import math
import os
import struct
import subprocess
import sys
import tempfile


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(path):
    with open(path, "rb") as f:
        data = f.read()
    offset = 0
    while offset < len(data):
        header = data[offset:offset + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[offset + 8:offset + 12])
        if masked(crc32c(header)) != length_crc:
            sys.exit(f"{path}: bad length checksum at byte {offset}")
        payload = data[offset + 12:offset + 12 + length]
        (payload_crc,) = struct.unpack("<I", data[offset + 12 + length:offset + 16 + length])
        if len(payload) != length or masked(crc32c(payload)) != payload_crc:
            sys.exit(f"{path}: bad or truncated payload at byte {offset}")
        yield payload
        offset += 16 + length


def main():
    source_dir, output_dir = sys.argv[1], sys.argv[2]
    events_files = glob.glob(os.path.join(output_dir, "events.out.tfevents.*"))
    if len(events_files) != 1:
        sys.exit(f"expected exactly one events file (rank 0's) in {output_dir}, found {events_files}")
    with tempfile.TemporaryDirectory() as gen:
        subprocess.run(["protoc", f"--python_out={gen}", f"-I{source_dir}", "proto/tensorboard.proto"], check=True)
        sys.path.insert(0, gen)
        tensorboard_pb2 = importlib.import_module("proto.tensorboard_pb2")

        seen = {}
        first = True
        for payload in records(events_files[0]):
            event = tensorboard_pb2.Event.FromString(payload)
            if first:
                if event.file_version != "brain.Event:2":
                    sys.exit(f"first event is not the file version: {event}")
                first = False
                continue
            for value in event.summary.value:
                task, metric = value.tag.split("/", 1)
                seen[(task, event.step, metric)] = value.simple_value

    expected = {}
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            for metric, number in row.items():
                if metric in ("step", "task"):
                    continue
                # TensorBoard scalars are float32.
                as_float = struct.unpack("<f", struct.pack("<f", number))[0] if number is not None else math.nan
                expected[(row["task"], row["step"], metric)] = as_float

    if set(seen) != set(expected):
        sys.exit(f"tags differ: only in events {sorted(set(seen) - set(expected))[:5]}, "
                 f"only in jsonl {sorted(set(expected) - set(seen))[:5]}")
    for key, value in expected.items():
        got = seen[key]
        if not (got == value or (math.isnan(got) and math.isnan(value))):
            sys.exit(f"{key}: events file has {got}, metrics.jsonl has {value}")
    tasks = sorted({k[0] for k in seen})
    steps = sorted({k[1] for k in seen})
    print(f"OK: {len(seen)} scalars ({', '.join(tasks)}; steps {steps[0]}..{steps[-1]}) match metrics.jsonl, "
          f"every record checksum verified")


if __name__ == "__main__":
    main()
