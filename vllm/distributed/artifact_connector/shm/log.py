# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The index log of a ``/dev/shm`` store: its on-disk format.

``index.log`` is a header followed by *batches*. A batch is a 16-byte header
(magic, record count, CRC-32 of the records, CRC-32 of the header) and
64-byte records. The writer appends one batch per publication with one
``pwrite``; a reader applies batches in order and stops at the first one
whose magic or CRCs do not match (still being written, or torn by a killed
writer): the bytes a batch names were written before the batch, so a reader
sees an object whole or not at all. Compaction replaces the file by a
snapshot (a new inode, renamed over the old name); readers that notice the
new inode reload it.
"""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np

from vllm.distributed.artifact_connector.store import UnsafeStoreError

LOG_MAGIC = b"VARTLOG3"
LOG_VERSION = 3
LOG_HEADER = struct.Struct("<8sH6xI")  # magic, version, header crc: 20 bytes
BATCH_MAGIC = b"VBAT"
BATCH_HEADER = struct.Struct("<4sIII")  # magic, count, records crc, header crc

# Record types.
PUT = 1  # a version that is (now) the key's current one
PUT_OLD = 2  # a version that exists but is not current (snapshots only)
MOVE = 3  # a version moved to another arena location
RETIRE = 5  # an arena was unlinked: the versions still in it are gone

RECORD_DTYPE = np.dtype(
    [
        ("type", "u1"),
        ("pad", "V3"),
        ("arena", "<u4"),
        ("key", "V32"),
        ("off", "<u8"),
        ("len", "<u8"),
        ("cs", "<u8"),
    ]
)
RECORD_NBYTES = RECORD_DTYPE.itemsize  # 64


def header_bytes() -> bytes:
    head = struct.pack("<8sH6x", LOG_MAGIC, LOG_VERSION)
    return head + struct.pack("<I", zlib.crc32(head))


def check_header(raw: bytes) -> None:
    """Raise :class:`UnsafeStoreError` unless ``raw`` is this format's
    header."""
    if len(raw) < LOG_HEADER.size:
        raise UnsafeStoreError("artifact index log is truncated")
    magic, version, crc = LOG_HEADER.unpack(raw[: LOG_HEADER.size])
    if (
        magic != LOG_MAGIC
        or version != LOG_VERSION
        or crc != zlib.crc32(raw[: LOG_HEADER.size - 4])
    ):
        raise UnsafeStoreError(
            "artifact index log has an unknown format (written by another "
            "version of this fork?)"
        )


def records(
    rtype: int | np.ndarray,
    keys_raw: bytes,
    arena: int | np.ndarray,
    off: int | np.ndarray = 0,
    length: int | np.ndarray = 0,
    cs: int | np.ndarray = 0,
) -> np.ndarray:
    """Records for the keys in ``keys_raw`` (32 bytes each); the other
    fields broadcast."""
    recs = np.zeros(len(keys_raw) // 32, RECORD_DTYPE)
    recs["type"] = rtype
    recs["arena"] = arena
    recs["key"] = np.frombuffer(keys_raw, "V32")
    recs["off"] = off
    recs["len"] = length
    recs["cs"] = cs
    return recs


def encode_batch(recs: np.ndarray) -> bytes:
    body = recs.tobytes()
    head = struct.pack("<4sII", BATCH_MAGIC, recs.shape[0], zlib.crc32(body))
    return head + struct.pack("<I", zlib.crc32(head)) + body


def read_batches(fd: int, offset: int) -> tuple[np.ndarray, int]:
    """The records of every complete batch from ``offset`` on, and the
    offset after the last one."""
    size = os.fstat(fd).st_size
    if size <= offset:
        return np.zeros(0, RECORD_DTYPE), offset
    buf = os.pread(fd, size - offset, offset)
    pos = 0
    hs = BATCH_HEADER.size
    bodies = []
    while pos + hs <= len(buf):
        magic, count, body_crc, head_crc = BATCH_HEADER.unpack_from(buf, pos)
        if magic != BATCH_MAGIC or head_crc != zlib.crc32(buf[pos : pos + hs - 4]):
            break
        end = pos + hs + count * RECORD_NBYTES
        if end > len(buf) or zlib.crc32(buf[pos + hs : end]) != body_crc:
            break
        bodies.append(buf[pos + hs : end])
        pos = end
    return np.frombuffer(b"".join(bodies), RECORD_DTYPE), offset + pos
