# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Artifact objects in a Mooncake Store, shared by every engine of a key
space.

One Mooncake object per artifact object, ``vllm-artifact/<key>``: a 16-byte
header (the checksum and length of the bytes) and the bytes, written in one
batched upsert. The last put of a key is the one read, as in the
``/dev/shm`` store; a read gets one whole put or nothing, and verifies it
against its header before returning anything.

One object, not a version and a pointer to it: Mooncake places every object
in some engine's segment and drops it with that segment, so two objects per
key could be split (a pointer surviving an engine restart that took its
version), and a scheduler that found the key would take KV whose routes
are gone. With one object, a key that exists can be read.

Mooncake may evict an object under memory pressure, and forgets everything
when its master restarts: a missing object is a miss, never a partial
answer.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm.distributed.artifact_connector.mooncake.client import (
    BUFFER_TOO_SMALL,
    OBJECT_NOT_FOUND,
    MooncakeUnavailableError,
)
from vllm.distributed.artifact_connector.store import (
    ChecksumMismatchError,
    ObjectRef,
    checksum,
)

PREFIX = "vllm-artifact/"
HEADER = np.dtype([("checksum", "<u8"), ("nbytes", "<u8")])
_H = HEADER.itemsize


class _Staging:
    """A buffer registered with the client (Mooncake moves bytes only from
    and into registered memory), grown on demand."""

    def __init__(self, client: Any, nbytes: int) -> None:
        self._client = client
        self.buf = np.empty(0, np.uint8)
        self.reserve(nbytes)

    def reserve(self, nbytes: int) -> np.ndarray:
        if nbytes > self.buf.nbytes:
            self.close()
            buf = np.empty(max(nbytes, 2 * self.buf.nbytes), np.uint8)
            rc = self._client.register_buffer(buf.ctypes.data, buf.nbytes)
            if rc != 0:
                raise MooncakeUnavailableError(
                    f"Mooncake refused to register a {buf.nbytes}-byte buffer (rc {rc})"
                )
            self.buf = buf
        return self.buf

    def close(self) -> None:
        if self.buf.nbytes:
            self._client.unregister_buffer(self.buf.ctypes.data)
            self.buf = np.empty(0, np.uint8)


def _runs(sizes: np.ndarray) -> list[tuple[int, int]]:
    """``[start, stop)`` of each run of equal consecutive sizes: full blocks
    come as one run, so they are copied as one 2-D assignment."""
    if not len(sizes):
        return []
    cuts = (np.flatnonzero(np.diff(sizes)) + 1).tolist()
    return list(zip([0, *cuts], [*cuts, len(sizes)]))


class MooncakeObjects:
    """Put, test and fetch artifact objects in a Mooncake Store (see the
    module docs). Thread-safe (one lock: the staging buffer).

    ``max_object_nbytes`` bounds the objects :meth:`fetch` reads (the key
    space's full block: its block size times its row size, plus the
    envelope)."""

    def __init__(
        self,
        client: Any,
        master: str,
        *,
        max_object_nbytes: int = 0,
        staging_bytes: int = 4 << 20,
    ) -> None:
        self.master = master
        self.max_object_nbytes = max_object_nbytes
        self._client = client
        self._lock = threading.Lock()
        self._staging = _Staging(client, staging_bytes)

    def close(self) -> None:
        with self._lock:
            self._staging.close()

    # ------------------------------------------------------------ writes
    def put(
        self,
        keys: Sequence[str],
        refs: Sequence[ObjectRef],
        data: np.ndarray,
        offsets: np.ndarray,
    ) -> int:
        """Put ``keys`` (object ``i`` is ``data[offsets[i]: offsets[i] +
        refs[i].nbytes]``, objects back to back); returns how many of the
        ``len(keys)`` writes Mooncake refused."""
        n = len(keys)
        if not n:
            return 0
        sizes = np.fromiter((r.nbytes for r in refs), np.int64, n)
        header = np.empty(n, HEADER)
        header["checksum"] = np.fromiter((r.checksum for r in refs), np.uint64, n)
        header["nbytes"] = sizes
        header_bytes = header.view(np.uint8).reshape(n, _H)
        at = np.asarray(offsets, np.int64) + _H * np.arange(1, n + 1)  # bytes
        with self._lock:
            buf = self._staging.reserve(int(data.nbytes) + n * _H)
            for a, b in _runs(sizes):
                s, o = int(sizes[a]), int(at[a]) - _H
                dst = buf[o : o + (b - a) * (_H + s)].reshape(b - a, _H + s)
                dst[:, :_H] = header_bytes[a:b]
                src = int(offsets[a])
                dst[:, _H:] = data[src : src + (b - a) * s].reshape(b - a, s)
            base = buf.ctypes.data
            rcs = self._client.batch_upsert_from(
                [PREFIX + k for k in keys], (base + at - _H).tolist(),
                (sizes + _H).tolist(),
            )  # fmt: skip
        return sum(1 for rc in rcs if rc < 0)

    # ------------------------------------------------------------ reads
    def fetch(self, keys: Sequence[str]) -> tuple[list[ObjectRef], np.ndarray]:
        """The objects of ``keys`` that Mooncake has, each verified against
        its header, and their bytes back to back (in ``keys``' order).
        Raises :class:`MooncakeUnavailableError` when the master cannot
        answer and :class:`ChecksumMismatchError` for an object that does
        not match its header."""
        n = len(keys)
        if not n:
            return [], np.empty(0, np.uint8)
        slot = _H + self.max_object_nbytes
        with self._lock:
            buf = self._staging.reserve(n * slot)
            base = buf.ctypes.data
            rcs = np.asarray(
                self._client.batch_get_into(
                    [PREFIX + k for k in keys], (base + slot * np.arange(n)).tolist(),
                    [slot] * n,
                ),
                np.int64,
            )  # fmt: skip
            self._raise_for(rcs, keys)
            present = np.flatnonzero(rcs != OBJECT_NOT_FOUND)
            slots = buf[: n * slot].reshape(n, slot)
            header = np.ascontiguousarray(slots[present, :_H]).view(HEADER).ravel()
            sizes = rcs[present] - _H
            wrong = np.flatnonzero(header["nbytes"] != sizes)
            if len(wrong):
                raise ChecksumMismatchError(
                    f"artifact object {keys[int(present[wrong[0]])]} read from the "
                    f"Mooncake Store (master {self.master}) does not match its "
                    "recorded length"
                )
            offsets = np.zeros(len(present), np.int64)
            np.cumsum(sizes[:-1], out=offsets[1:])
            data = np.empty(int(sizes.sum()), np.uint8)
            for a, b in _runs(sizes):
                s, o = int(sizes[a]), int(offsets[a])
                rows = data[o : o + (b - a) * s].reshape(b - a, s)
                rows[:] = slots[present[a:b], _H : _H + s]
        mv = data.data
        refs = []
        for j, i in enumerate(present.tolist()):
            o, s, want = int(offsets[j]), int(sizes[j]), int(header["checksum"][j])
            if checksum(mv[o : o + s]) != want:
                raise ChecksumMismatchError(
                    f"artifact object {keys[i]} read from the Mooncake Store "
                    f"(master {self.master}) does not match its checksum"
                )
            refs.append(ObjectRef(keys[i], want, s))
        return refs, data

    def _raise_for(self, rcs: np.ndarray, keys: Sequence[str]) -> None:
        bad = np.flatnonzero((rcs < _H) & (rcs != OBJECT_NOT_FOUND))
        if not len(bad):
            return
        key, rc = keys[int(bad[0])], int(rcs[bad[0]])
        where = f"artifact object {key} in the Mooncake Store (master {self.master})"
        if rc >= 0:
            raise ChecksumMismatchError(f"{where} is shorter than its header")
        if rc == BUFFER_TOO_SMALL:
            raise MooncakeUnavailableError(
                f"{where} is larger than this key space's objects "
                f"({self.max_object_nbytes} bytes); do all its engines use the "
                "same routed_experts_dtype?"
            )
        raise MooncakeUnavailableError(
            f"{where} could not be read (Mooncake error {rc}); is mooncake_master "
            "running?"
        )
