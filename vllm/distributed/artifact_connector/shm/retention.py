# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Retention bookkeeping of a ``/dev/shm`` store: which keys live request
attempts (owners) hold. An object of a retained key is never evicted: an
eviction moves it into the active arena first. An owner holds a key once,
however often it retains it; a key is retained while any owner holds it."""

from __future__ import annotations

from collections.abc import Iterable


class Retention:
    def __init__(self) -> None:
        self._count: dict[str, int] = {}  # key -> owners holding it
        self._held: dict[str, set[str]] = {}  # owner -> keys it holds

    def retain(self, owner: str, keys: Iterable[str]) -> None:
        self._held.setdefault(owner, set())  # an owner, even with no keys
        keys = list(keys)
        self.retain_each([owner] * len(keys), keys)

    def retain_each(self, owners: list[str], keys: list[str]) -> None:
        """Owner ``owners[i]`` retains ``keys[i]`` (a batch's objects)."""
        held_of = self._held
        counts = self._count
        held: set[str] = set()
        last: str | None = None
        for owner, key in zip(owners, keys):
            if owner != last:  # consecutive objects mostly share an owner
                held = held_of.setdefault(owner, set())
                last = owner
            if key not in held:
                held.add(key)
                counts[key] = counts.get(key, 0) + 1

    def release(self, owner: str) -> int:
        """Drop everything ``owner`` holds; returns how many keys."""
        held = self._held.pop(owner, None)
        if not held:
            return 0
        counts = self._count
        for key in held:
            n = counts[key] - 1
            if n:
                counts[key] = n
            else:
                del counts[key]
        return len(held)

    def __contains__(self, key: str) -> bool:
        return key in self._count

    @property
    def num_keys(self) -> int:
        return len(self._count)

    @property
    def num_owners(self) -> int:
        return len(self._held)

    @property
    def num_holds(self) -> int:
        """(owner, key) pairs."""
        return sum(self._count.values())
