# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The in-memory index of a ``/dev/shm`` store: where each object version
lives. The writer keeps the authoritative one; each reader rebuilds its own
from the index log.

A version lives in a *slot*: one entry of parallel numpy arrays (arena id,
offset, length, checksum, raw key). ``current`` maps a key to the slot of
its current version; ``older`` holds the slots of a key's other versions,
which exist only after a divergence (rare). Keeping locations in arrays
rather than one Python object per version keeps a store of millions of
objects at about 100 bytes of index per object.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from vllm.distributed.artifact_connector.shm import log
from vllm.distributed.artifact_connector.store import KEY_HEX_LEN, PutStatus


def hex_keys(raw: bytes) -> list[str]:
    """Hex keys of raw 32-byte keys laid back to back."""
    hexed = raw.hex()
    return [hexed[i : i + KEY_HEX_LEN] for i in range(0, len(hexed), KEY_HEX_LEN)]


class Index:
    def __init__(self) -> None:
        self.current: dict[str, int] = {}
        self.older: dict[str, list[int]] = {}
        self.arena = np.zeros(0, np.int64)
        self.off = np.zeros(0, np.int64)
        self.length = np.zeros(0, np.int64)
        self.cs = np.zeros(0, np.uint64)
        self.key_raw = np.zeros(0, "V32")
        self.live = np.zeros(0, np.bool_)
        self._free: list[int] = []
        self._top = 0
        self.num_versions = 0

    # ------------------------------------------------------------ slots
    def _alloc(self, n: int) -> np.ndarray:
        reuse = [self._free.pop() for _ in range(min(n, len(self._free)))]
        fresh = n - len(reuse)
        if self._top + fresh > self.arena.shape[0]:
            cap = max(1024, 2 * self.arena.shape[0], self._top + fresh)
            for name in ("arena", "off", "length", "cs", "key_raw", "live"):
                old = getattr(self, name)
                grown = np.zeros(cap, old.dtype)
                grown[: old.shape[0]] = old
                setattr(self, name, grown)
        slots = np.concatenate(
            (np.array(reuse, np.int64), np.arange(self._top, self._top + fresh))
        ).astype(np.int64)
        self._top += fresh
        self.live[slots] = True
        self.num_versions += n
        return slots

    def find(self, key: str, cs: int) -> int | None:
        """Slot of version ``cs`` of ``key``."""
        s = self.current.get(key)
        if s is not None and int(self.cs[s]) == cs:
            return s
        for s in self.older.get(key, ()):
            if int(self.cs[s]) == cs:
                return s
        return None

    def has_key(self, key: str) -> bool:
        return key in self.current or key in self.older

    def classify(
        self,
        keys: list[str],
        cs: np.ndarray,
        locs: np.ndarray,
        offs: np.ndarray,
        lens: np.ndarray,
        same_bytes: Callable[[int, int, int, int], bool],
    ) -> list[PutStatus]:
        """Status of each object of a batch about to be indexed at ``locs``
        / ``offs``. An identical version (same checksum and, by
        ``same_bytes(slot, arena, off, len)``, the same bytes) that exists
        already, or earlier in the batch, is pointed at instead: its
        ``locs``/``offs`` are updated, and the fresh copy stays unindexed."""
        if (
            self.current.keys().isdisjoint(keys)
            and self.older.keys().isdisjoint(keys)
            and len(set(keys)) == len(keys)
        ):
            return [PutStatus.WRITTEN] * len(keys)
        statuses = []
        seen: dict[tuple[str, int], int] = {}
        for i, key in enumerate(keys):
            c = int(cs[i])
            s = self.find(key, c)
            if s is not None and same_bytes(s, locs[i], offs[i], lens[i]):
                locs[i], offs[i] = self.arena[s], self.off[s]
                statuses.append(PutStatus.IDENTICAL)
            elif (key, c) in seen:  # repeated within the batch
                j = seen[(key, c)]
                locs[i], offs[i] = locs[j], offs[j]
                statuses.append(PutStatus.IDENTICAL)
            else:
                repeated = any(k == key for k, _ in seen)
                diverged = self.has_key(key) or repeated
                statuses.append(PutStatus.DIVERGED if diverged else PutStatus.WRITTEN)
                seen[(key, c)] = i
        return statuses

    def put(
        self,
        keys: list[str],
        keys_raw: bytes,
        arena: np.ndarray | int,
        off: np.ndarray,
        length: np.ndarray,
        cs: np.ndarray,
        *,
        current: bool = True,
    ) -> None:
        """Add versions; with ``current`` each becomes its key's current
        version (an existing identical version is reused, a previous
        current one becomes older)."""
        if (
            current
            and self.current.keys().isdisjoint(keys)
            and self.older.keys().isdisjoint(keys)
            and len(set(keys)) == len(keys)
        ):
            # The common case, vectorised: distinct keys that are all new.
            slots = self._alloc(len(keys))
            self.arena[slots] = arena
            self.off[slots] = off
            self.length[slots] = length
            self.cs[slots] = cs
            self.key_raw[slots] = np.frombuffer(keys_raw, "V32")
            self.current.update(zip(keys, slots.tolist()))
            return
        arenas = np.broadcast_to(np.asarray(arena, np.int64), (len(keys),))
        for i, key in enumerate(keys):
            c = int(cs[i])
            s = self.find(key, c)
            if s is None:
                s = int(self._alloc(1)[0])
                self.cs[s] = c
                self.key_raw[s] = keys_raw[32 * i : 32 * i + 32]
            else:
                self._unlink(key, s)
            self.arena[s], self.off[s], self.length[s] = arenas[i], off[i], length[i]
            if current:
                prev = self.current.get(key)
                if prev is not None:
                    self.older.setdefault(key, []).append(prev)
                self.current[key] = s
            else:
                self.older.setdefault(key, []).append(s)

    def _unlink(self, key: str, slot: int) -> None:
        """Detach ``slot`` from ``key``'s versions (the slot stays live)."""
        if self.current.get(key) == slot:
            del self.current[key]
            return
        rest = self.older.get(key, [])
        if slot in rest:
            rest.remove(slot)
            if not rest:
                del self.older[key]

    def move(self, slot: int, arena: int, off: int) -> None:
        self.arena[slot], self.off[slot] = arena, off

    def apply(self, recs: np.ndarray) -> list[int]:
        """Apply log records in order; returns the retired arena ids."""
        n = recs.shape[0]
        if n == 0:
            return []
        keys_raw = recs["key"].tobytes()
        keys = hex_keys(keys_raw)
        types = recs["type"]
        if (types == log.PUT).all():
            self.put(
                keys,
                keys_raw,
                recs["arena"].astype(np.int64),
                recs["off"].astype(np.int64),
                recs["len"].astype(np.int64),
                recs["cs"].astype(np.uint64),
            )
            return []
        retired = []
        for i, (rtype, key) in enumerate(zip(types.tolist(), keys)):
            r = recs[i : i + 1]
            if rtype in (log.PUT, log.PUT_OLD):
                self.put(
                    [key],
                    keys_raw[32 * i : 32 * i + 32],
                    int(r["arena"][0]),
                    r["off"].astype(np.int64),
                    r["len"].astype(np.int64),
                    r["cs"].astype(np.uint64),
                    current=rtype == log.PUT,
                )
            elif rtype == log.MOVE:
                s = self.find(key, int(r["cs"][0]))
                if s is not None:
                    self.move(s, int(r["arena"][0]), int(r["off"][0]))
            elif rtype == log.RETIRE:
                aid = int(r["arena"][0])
                self.drop_arena(aid)
                retired.append(aid)
        return retired

    def drop_arena(self, aid: int) -> int:
        """Drop every version still located in arena ``aid``; returns how
        many."""
        slots = self.slots_in_arena(aid)
        current, older = self.current, self.older
        for key, s in zip(self.keys_of(slots), slots.tolist()):
            if current.get(key) == s and key not in older:
                del current[key]  # the common case: the key's only version
            else:
                self._unlink(key, s)
        self.live[slots] = False
        self._free.extend(slots.tolist())
        self.num_versions -= int(slots.shape[0])
        return int(slots.shape[0])

    # ------------------------------------------------------------ queries
    def live_slots(self) -> np.ndarray:
        return np.flatnonzero(self.live[: self._top])

    def slots_in_arena(self, aid: int) -> np.ndarray:
        live = self.live_slots()
        return live[self.arena[live] == aid]

    def keys_of(self, slots: np.ndarray) -> list[str]:
        return hex_keys(self.key_raw[slots].tobytes())

    def snapshot(self) -> np.ndarray:
        """Records that rebuild this index: older versions first, then the
        current ones (a later ``PUT`` makes its version current)."""
        cur = np.fromiter(self.current.values(), np.int64, len(self.current))
        old = np.array([s for v in self.older.values() for s in v], np.int64)
        parts = []
        for rtype, slots in ((log.PUT_OLD, old), (log.PUT, cur)):
            recs = np.zeros(slots.shape[0], log.RECORD_DTYPE)
            recs["type"] = rtype
            recs["arena"] = self.arena[slots]
            recs["key"] = self.key_raw[slots]
            recs["off"] = self.off[slots]
            recs["len"] = self.length[slots]
            recs["cs"] = self.cs[slots]
            parts.append(recs)
        return np.concatenate(parts)
