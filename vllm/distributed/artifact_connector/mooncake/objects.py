# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Artifact objects in a Mooncake Store, shared by every engine of a key
space.

One Mooncake object per artifact object, ``vllm-artifact/<key>``: a 32-byte
header (the checksum and length of the bytes, and a MAC) and the bytes,
written in one batched put. **The first put of a key is the one kept**
(Mooncake's put leaves an existing object as it is), as vLLM's
``ExampleConnector`` keeps the first KV stored for a prompt: an engine that
loads a block's KV from the pool and its routes from here gets the routes
of the engine that computed that KV, not of a later engine that computed the
block again (a near-tie routed the other way in another batch). A read gets
one whole put or nothing, and verifies it before returning anything.

Trust: anyone who reaches the master can write, overwrite or delete any
object (Mooncake has no access control). The MAC, a keyed BLAKE2b of the
object's name, header and bytes under a key derived from the deployment
secret (``shared_secret_file``), is what makes a read trustworthy: an object
that fails it (planted, altered, or written under another secret), its
length or its checksum is treated as missing, never returned, and is
removed (:meth:`MooncakeObjects.remove`): under the first-put rule it would
otherwise hold its key against every genuine put, and every engine would
recompute the block forever. Engines of one key space hold one secret (the
key space's terms fingerprint it), so an object that fails is never a
genuine one. A deletion cannot be prevented; it costs a recomputation.

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

import hashlib
import hmac
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm.distributed.artifact_connector.mooncake.client import (
    BUFFER_TOO_SMALL,
    OBJECT_NOT_FOUND,
    MooncakeUnavailableError,
    own_segment,
)
from vllm.distributed.artifact_connector.store import ObjectRef, checksum
from vllm_host_transport.mooncake_probe import describe_error

PREFIX = "vllm-artifact/"
HEADER = np.dtype([("checksum", "<u8"), ("nbytes", "<u8"), ("mac", "V16")])
_H = HEADER.itemsize
_SIGNED = 16  # the header's bytes the MAC covers (checksum, nbytes)


def mac_key(secret: bytes) -> bytes:
    """The key of the objects' MACs, derived from the deployment secret."""
    return hashlib.blake2b(secret, digest_size=32, person=b"vllm-r3-objects").digest()


def object_mac(key: bytes, name: str, signed: Any, data: Any) -> bytes:
    """The MAC of object ``name``: its header's ``signed`` bytes and its
    bytes ``data`` (buffers: bytes, memoryviews, uint8 arrays)."""
    h = hashlib.blake2b(name.encode(), digest_size=16, key=key)
    h.update(signed)
    h.update(data)
    return h.digest()


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
    envelope); ``secret`` is the deployment secret."""

    def __init__(
        self,
        client: Any,
        master: str,
        *,
        secret: bytes,
        max_object_nbytes: int = 0,
        staging_bytes: int = 4 << 20,
    ) -> None:
        self.master = master
        self.max_object_nbytes = max_object_nbytes
        self._mac_key = mac_key(secret)
        self._client = client
        self._placement = own_segment(client)  # an engine's objects go with it
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
        refs[i].nbytes]``, objects back to back) where they are not in the
        store yet (a key already there keeps its object: see the module
        docs); returns how many of the ``len(keys)`` writes Mooncake
        refused.

        Mooncake's put leaves an existing object and reports success, so a
        key taken by an object that fails authentication (planted before
        this engine computed the block) would swallow the genuine write:
        keys that exist are read and checked first, and those that fail are
        removed and written (a genuine object there is kept, and counts as
        put: it is what other engines should take)."""
        if not len(keys):
            return 0
        exists = self._client.batch_is_exist([PREFIX + k for k in keys])
        taken = [i for i, e in enumerate(exists) if e == 1]
        if taken:
            got, _, rejected = self.fetch([keys[i] for i in taken])
            if rejected:
                self.remove(rejected)
            genuine = {r.key for r in got}
            write = [i for i, k in enumerate(keys) if k not in genuine]
            if len(write) < len(keys):
                if not write:
                    return 0
                lens = np.fromiter((refs[i].nbytes for i in write), np.int64)
                offs = np.asarray(offsets, np.int64)[write]
                data = np.concatenate(
                    [data[o : o + s] for o, s in zip(offs.tolist(), lens.tolist())]
                )
                offsets = np.zeros(len(write), np.int64)
                np.cumsum(lens[:-1], out=offsets[1:])
                keys = [keys[i] for i in write]
                refs = [refs[i] for i in write]
        n = len(keys)
        sizes = np.fromiter((r.nbytes for r in refs), np.int64, n)
        header = np.empty(n, HEADER)
        header["checksum"] = np.fromiter((r.checksum for r in refs), np.uint64, n)
        header["nbytes"] = sizes
        header_bytes = header.view(np.uint8).reshape(n, _H)
        mk, mv, offs = self._mac_key, data.data, offsets.tolist()
        header["mac"] = [
            object_mac(mk, PREFIX + k, header_bytes[i, :_SIGNED], mv[o : o + s])
            for i, (k, o, s) in enumerate(zip(keys, offs, sizes.tolist()))
        ]
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
            rcs = self._client.batch_put_from(
                [PREFIX + k for k in keys], (base + at - _H).tolist(),
                (sizes + _H).tolist(), self._placement,
            )  # fmt: skip
        return sum(1 for rc in rcs if rc < 0)

    # ------------------------------------------------------------ reads
    def fetch(
        self, keys: Sequence[str]
    ) -> tuple[list[ObjectRef], np.ndarray, list[str]]:
        """The objects of ``keys`` that Mooncake has and that pass their
        checks (length, MAC, checksum), with their bytes back to back (in
        ``keys``' order), and the keys of those that failed them (treated
        as missing). Raises :class:`MooncakeUnavailableError` when the
        master cannot answer."""
        n = len(keys)
        if not n:
            return [], np.empty(0, np.uint8), []
        slot = _H + self.max_object_nbytes
        mk = self._mac_key
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
            slots = buf[: n * slot].reshape(n, slot)
            good: list[tuple[int, int, int]] = []  # (index, nbytes, checksum)
            rejected: list[str] = []
            for i in np.flatnonzero(rcs != OBJECT_NOT_FOUND).tolist():
                size = int(rcs[i]) - _H
                head = slots[i, :_H].view(HEADER)[0]
                body = slots[i, _H : _H + max(size, 0)]
                if (
                    size < 0
                    or int(head["nbytes"]) != size
                    or not hmac.compare_digest(
                        object_mac(mk, PREFIX + keys[i], slots[i, :_SIGNED], body),
                        bytes(head["mac"]),
                    )
                    or checksum(body.data) != int(head["checksum"])
                ):
                    rejected.append(keys[i])
                    continue
                good.append((i, size, int(head["checksum"])))
            which = np.fromiter((i for i, _, _ in good), np.int64, len(good))
            sizes = np.fromiter((s for _, s, _ in good), np.int64, len(good))
            offsets = np.zeros(len(good), np.int64)
            np.cumsum(sizes[:-1], out=offsets[1:])
            data = np.empty(int(sizes.sum()), np.uint8)
            for a, b in _runs(sizes):
                s, o = int(sizes[a]), int(offsets[a])
                rows = data[o : o + (b - a) * s].reshape(b - a, s)
                rows[:] = slots[which[a:b], _H : _H + s]
        refs = [ObjectRef(keys[i], want, size) for i, size, want in good]
        return refs, data, rejected

    def remove(self, keys: Sequence[str]) -> None:
        """Remove the objects of ``keys`` that failed their checks (forced:
        a read's lease does not keep them). A key already gone, or put again
        meanwhile by a genuine engine and removed here, costs a
        recomputation, never a wrong answer."""
        for k in keys:
            self._client.remove(PREFIX + k, True)

    def _raise_for(self, rcs: np.ndarray, keys: Sequence[str]) -> None:
        # An object too large for its slot (planted, or another dtype's) is
        # one that fails its checks, not a fault of the tier.
        bad = np.flatnonzero(
            (rcs < 0) & (rcs != OBJECT_NOT_FOUND) & (rcs != BUFFER_TOO_SMALL)
        )
        if not len(bad):
            return
        key, rc = keys[int(bad[0])], int(rcs[bad[0]])
        where = f"artifact object {key} in the Mooncake Store (master {self.master})"
        raise MooncakeUnavailableError(
            f"{where} could not be read: {describe_error(rc)}"
        )
