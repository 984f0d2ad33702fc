# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Artifact objects in a Mooncake Store, shared by every engine of a key
space.

Two Mooncake objects per artifact object, both written in one batched call
each:

* the **version** ``vllm-artifact/<key>/<checksum>``: the object's bytes.
  Its name carries its checksum, so it is immutable: two engines that put
  the same key with the same bytes write the same version, and an engine
  whose bytes differ (a near-tie routed the other way in another batch)
  writes its own version beside it instead of replacing the first;
* the **pointer** ``vllm-artifact/<key>``: 16 bytes, the checksum and
  length of the key's current version (the last one put, as in the
  ``/dev/shm`` store).

A lookup reads pointers; a fetch reads versions and verifies every
checksum before returning anything. Mooncake may evict either under
memory pressure, and forgets everything when its master restarts: a
missing pointer or version is a miss, never a partial answer.
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
_POINTER = np.dtype([("checksum", "<u8"), ("nbytes", "<u8")])


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


class MooncakeObjects:
    """Put, look up and fetch artifact objects in a Mooncake Store (see the
    module docs). Thread-safe (one lock: the staging buffer)."""

    def __init__(self, client: Any, master: str, staging_bytes: int = 4 << 20) -> None:
        self.master = master
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
        """Put the versions of ``keys`` (object ``i`` is ``data[offsets[i]:
        offsets[i] + refs[i].nbytes]``) and point the keys at them; returns
        how many of the ``2 * len(keys)`` Mooncake writes failed."""
        n = len(keys)
        if not n:
            return 0
        sizes = np.fromiter((r.nbytes for r in refs), np.int64, n)
        total = int(data.nbytes)
        with self._lock:
            buf = self._staging.reserve(total + n * _POINTER.itemsize)
            buf[:total] = data
            pointers = buf[total : total + n * _POINTER.itemsize].view(_POINTER)
            pointers["checksum"] = np.fromiter((r.checksum for r in refs), np.uint64, n)
            pointers["nbytes"] = sizes
            base = buf.ctypes.data
            versions = [f"{PREFIX}{k}/{r.checksum:016x}" for k, r in zip(keys, refs)]
            rcs = self._client.batch_put_from(
                versions, (base + offsets).tolist(), sizes.tolist()
            )
            # Pointers after versions: a pointer never names a version that
            # is not there yet.
            rcs += self._client.batch_upsert_from(
                [PREFIX + k for k in keys],
                (base + total + _POINTER.itemsize * np.arange(n)).tolist(),
                [_POINTER.itemsize] * n,
            )
        return sum(1 for rc in rcs if rc < 0)

    # ------------------------------------------------------------ reads
    def lookup(self, keys: Sequence[str]) -> list[ObjectRef | None]:
        """The current version of each key (``None`` where Mooncake has no
        pointer). Raises :class:`MooncakeUnavailableError` when the master
        cannot answer."""
        n = len(keys)
        if not n:
            return []
        with self._lock:
            buf = self._staging.reserve(n * _POINTER.itemsize)
            base = buf.ctypes.data
            rcs = self._client.batch_get_into(
                [PREFIX + k for k in keys],
                (base + _POINTER.itemsize * np.arange(n)).tolist(),
                [_POINTER.itemsize] * n,
            )
            found = buf[: n * _POINTER.itemsize].view(_POINTER).copy()
        self._raise_for(rcs, keys, expect=[_POINTER.itemsize] * n)
        return [
            ObjectRef(k, int(p["checksum"]), int(p["nbytes"]))
            if rc == _POINTER.itemsize
            else None
            for k, p, rc in zip(keys, found, rcs)
        ]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key has a pointer (metadata only: about a tenth of
        :meth:`lookup`'s time, docs/benchmarks.md). Raises
        :class:`MooncakeUnavailableError` when the master cannot answer."""
        if not keys:
            return []
        found = self._client.batch_is_exist([PREFIX + k for k in keys])
        if any(f < 0 for f in found):
            raise MooncakeUnavailableError(
                f"the Mooncake Store (master {self.master}) could not say which "
                "artifact objects it has; is mooncake_master running?"
            )
        return [f == 1 for f in found]

    def fetch(self, refs: Sequence[ObjectRef]) -> tuple[np.ndarray, np.ndarray]:
        """The exact versions ``refs`` back to back, each verified against its
        checksum, and their offsets; a version Mooncake no longer has drops
        out (the returned refs' order is kept for the rest): returns
        ``(data, present)`` where ``present`` indexes ``refs``."""
        n = len(refs)
        sizes = np.fromiter((r.nbytes for r in refs), np.int64, n)
        offsets = np.zeros(n, np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        total = int(sizes.sum())
        with self._lock:
            buf = self._staging.reserve(total)
            base = buf.ctypes.data
            rcs = self._client.batch_get_into(
                [f"{PREFIX}{r.key}/{r.checksum:016x}" for r in refs],
                (base + offsets).tolist(),
                sizes.tolist(),
            )
            data = buf[:total].copy()
        self._raise_for(rcs, [r.key for r in refs], expect=sizes.tolist())
        present = np.flatnonzero(np.asarray(rcs, np.int64) == sizes)
        mv = data.data
        for i in present.tolist():
            o = int(offsets[i])
            if checksum(mv[o : o + refs[i].nbytes]) != refs[i].checksum:
                raise ChecksumMismatchError(
                    f"artifact object {refs[i].key} read from the Mooncake Store "
                    f"(master {self.master}) does not match its checksum"
                )
        if len(present) < n:
            data = data[np.repeat(np.asarray(rcs, np.int64) == sizes, sizes)]
        return data, present

    def _raise_for(self, rcs: Sequence[int], keys: Sequence[str], expect) -> None:
        for rc, key, want in zip(rcs, keys, expect):
            if rc in (OBJECT_NOT_FOUND, want):
                continue
            what = (
                "has a different size than recorded"
                if rc >= 0 or rc == BUFFER_TOO_SMALL
                else f"could not be read (Mooncake error {rc})"
            )
            raise MooncakeUnavailableError(
                f"artifact object {key} in the Mooncake Store (master "
                f"{self.master}) {what}; is mooncake_master running?"
            )
