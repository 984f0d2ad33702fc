# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Small helpers shared by the artifact store tests (and the child process
of the multi-process tests, which loads this file by path)."""

import hashlib
import json
import os

import numpy as np


def key(i: int) -> str:
    return hashlib.sha256(b"obj-%d" % i).hexdigest()


def payload(i: int, size: int) -> bytes:
    seed = hashlib.sha256(b"payload-%d" % i).digest()
    return (seed * (size // len(seed) + 1))[:size]


def put(writer, items, owner=None):
    """Publish ``(key, bytes)`` items through the one write path."""
    values = [v for _, v in items]

    def fill(buf):
        o = 0
        for v in values:
            buf[o : o + len(v)] = np.frombuffer(v, np.uint8)
            o += len(v)

    lengths = np.array([len(v) for v in values], np.int64)
    owners = None if owner is None else [owner] * len(items)
    return writer.put_batch([k for k, _ in items], lengths, fill, owners=owners)


def read_refs(reader, refs, out, spans, **kw):
    """``read_into`` for a list of :class:`ObjectRef`."""
    sums = np.array([r.checksum for r in refs], np.uint64)
    reader.read_into([r.key for r in refs], sums, out, np.asarray(spans), **kw)


def read(reader, refs):
    """Whole objects through the one read path, as bytes."""
    lens = [r.nbytes for r in refs]
    out = np.zeros(sum(lens), np.uint8)
    dst = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
    spans = np.stack([np.zeros(len(refs), np.int64), np.array(lens), dst], axis=1)
    read_refs(reader, refs, out, spans)
    return [out[d : d + n].tobytes() for d, n in zip(dst.tolist(), lens)]


def make_dead(ns_path: str) -> None:
    """Rewrite a store's writer record so that it names a pid that cannot
    exist (above pid_max): its writer is then proven gone."""
    fn = os.path.join(ns_path, "writer.json")
    with open(fn, "rb") as f:
        d = json.loads(f.read())
    d["pid"] = 2**22 + 12345
    with open(fn, "wb") as f:
        f.write(json.dumps(d).encode())
