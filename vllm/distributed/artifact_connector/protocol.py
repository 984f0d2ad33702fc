# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Scheduler <-> worker messages of the Artifact Connector.

Messages name request *attempts* (request id + attempt number; a preempted
request resumes as a new attempt), logical row ranges and KV block hashes:
never physical KV blocks or slots, never file paths. They are frozen
dataclasses of plain types, carried on ``SchedulerOutput`` and
``ModelRunnerOutput``.

Scheduler -> publishing worker, per step (:class:`ArtifactSchedulerMeta`):
attempt starts (with the prefix-hit block hashes to retain), newly known
block hashes, finalisations (a finish, or an abort, at the executed
boundary), discards (preemption), releases (the scheduler has read an
acknowledgement) and, with ``backend: mooncake``, the objects to pull into
the local store before a hit on KV another engine computed is taken.

Worker -> scheduler (:class:`ArtifactWorkerReport`): finalize
acknowledgements with the ordered references of every object that
covers the request, failures, the pulls that ended, and now and then the
store's counters (for the metrics, see ``metrics.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

# A request attempt: the request id and the attempt number (1, 2, ...; a
# preempted request resumes as the next attempt).
AttemptId = tuple[str, int]

# How long the scheduler waits for a finish's acknowledgement before it
# fails the request instead of hanging the engine.
ACK_TIMEOUT_S = 60.0
# How long it waits for the route reader to read an acknowledged request's
# routes: reads are of the local store, under a millisecond per batch, so a
# read this late means a stuck reader.
READ_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class AttemptStart:
    """An attempt begins. Rows ``[0, cached_rows)`` come from the prefix
    cache: ``prefix_hashes`` are the KV hashes of those ``cached_rows / B``
    blocks, whose objects the attempt retains (they may still be on their
    way from a sibling request). Rows from ``cached_rows`` on are computed."""

    req_id: str
    attempt: int
    cached_rows: int
    prefix_hashes: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class BlockHashes:
    """KV hashes (hash-block granularity) of full blocks ``[first_block,
    first_block + len(hashes))`` of an attempt."""

    req_id: str
    attempt: int
    first_block: int
    hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Finalize:
    """The request finished with ``num_rows`` executed rows (``N - 1``).
    Publish what is left (rows past ``num_rows`` are dropped), including the
    tail keyed by ``tail_hash`` (``None`` when ``num_rows`` is a multiple of
    the block size), then acknowledge. Waits for rows of steps still in
    flight."""

    req_id: str
    attempt: int
    num_rows: int
    tail_hash: bytes | None = None


@dataclass(frozen=True, slots=True)
class Abort(Finalize):
    """An abort is a finish at the executed boundary the scheduler names:
    the request returned tokens up to ``num_rows + 1``, and its routes cover
    exactly those (partial rollouts resume from them)."""


@dataclass(frozen=True, slots=True)
class Discard:
    """The attempt ends without output (preempted and recomputed, aborted
    before its first token or by a caller that is gone, failed). It drains:
    once its rows up to ``num_rows`` (the tokens it computed) have arrived,
    or the finalize wait has passed, it publishes its full blocks whose
    hashes are known (their KV stays cached; later prefix hits need their
    routes), drops the rest and releases what it retained."""

    req_id: str
    attempt: int
    num_rows: int = 0


@dataclass(frozen=True, slots=True)
class Release:
    """The scheduler has read the attempt's acknowledgement: release the
    objects the attempt retained."""

    req_id: str
    attempt: int


@dataclass(frozen=True, eq=False)
class ObjectRefs:
    """The objects that cover a request's rows ``[0, num_rows)``, in order,
    as columns (a 32k-token request has 2,048 of them): object ``i`` holds
    rows ``[starts[i], starts[i] + num_rows[i])`` under ``keys[i]``, exact
    version ``checksums[i]``, computed under ``weight_versions[i]``."""

    keys: tuple[str, ...]
    starts: np.ndarray  # int64
    num_rows: np.ndarray  # int64
    checksums: np.ndarray  # uint64
    weight_versions: tuple[str, ...]

    @classmethod
    def build(
        cls,
        keys: list[str],
        starts: list[int],
        num_rows: list[int],
        checksums: list[int],
        weight_versions: list[str],
    ) -> ObjectRefs:
        return cls(
            tuple(keys),
            np.array(starts, np.int64),
            np.array(num_rows, np.int64),
            np.array(checksums, np.uint64),
            tuple(weight_versions),
        )

    def __len__(self) -> int:
        return len(self.keys)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ObjectRefs)
            and self.keys == other.keys
            and self.weight_versions == other.weight_versions
            and np.array_equal(self.starts, other.starts)
            and np.array_equal(self.num_rows, other.num_rows)
            and np.array_equal(self.checksums, other.checksums)
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class FinalizeAck:
    """Finalisation done: ``refs`` cover rows ``[0, num_rows)`` in order
    (prefix-hit objects first, then the attempt's own). They are
    authoritative: the scheduler reads exactly these versions, which stay
    retained until it sends :class:`Release`."""

    req_id: str
    attempt: int
    num_rows: int
    refs: ObjectRefs
    aborted: bool = False


@dataclass(frozen=True, slots=True)
class AttemptFailed:
    """The worker could not publish or finalise an attempt; nothing of it
    stays retained. ``error_type`` is the exception class name, ``message``
    says the cause and the remedy. ``lost_block_hash``: the KV hash of a
    prefix-hit block whose routes are gone from the store (the scheduler
    drops it from the prefix cache, so the next request recomputes it)."""

    req_id: str
    attempt: int
    error_type: str
    message: str
    lost_block_hash: bytes | None = None


@dataclass(frozen=True, slots=True)
class PullRoutes:
    """A waiting request was offered KV another engine computed: copy the
    objects of ``keys`` (those of its blocks this store lacks) from the
    shared tier into the local store, and say when that ended
    (:attr:`ArtifactWorkerReport.pulled`), whatever it found."""

    req_id: str
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ArtifactSchedulerMeta:
    """Everything the scheduler tells the publishing worker in one step.
    ``weight_version``, when set, applies from this step on (before the
    step's attempt starts and rows)."""

    weight_version: str | None = None
    starts: tuple[AttemptStart, ...] = ()
    hashes: tuple[BlockHashes, ...] = ()
    finalizes: tuple[Finalize, ...] = ()
    discards: tuple[Discard, ...] = ()
    releases: tuple[Release, ...] = ()
    pulls: tuple[PullRoutes, ...] = ()

    def is_empty(self) -> bool:
        return not (
            self.starts
            or self.hashes
            or self.finalizes
            or self.discards
            or self.releases
            or self.pulls
        )


@dataclass(frozen=True, slots=True)
class ArtifactWorkerReport:
    """Everything the publishing worker reports back in one step.
    ``pulled``: the requests whose :class:`PullRoutes` ended. ``stats``, at
    most once a second: the store's counters (``ArtifactPublisher.metrics``)."""

    acks: tuple[FinalizeAck, ...] = ()
    failures: tuple[AttemptFailed, ...] = ()
    stats: dict[str, int] | None = None
    pulled: tuple[str, ...] = ()

    def is_empty(self) -> bool:
        return not (self.acks or self.failures or self.stats or self.pulled)


# ------------------------------------------------------------------ aborts
# The ABORT payload the frontend sends the engine core: a request id where a
# caller waits for the routes of the tokens it was sent, ``[id, False]``
# where the caller is gone (the engine then reads nothing for it).
def abort_items(req_ids: Iterable[str], caller_waits: bool) -> list[Any]:
    """ABORT payload entries for ``req_ids`` (see above)."""
    if caller_waits:
        return list(req_ids)
    return [[req_id, False] for req_id in req_ids]


def abort_item_id(item: Any) -> str:
    """The request id of one :func:`abort_items` entry."""
    return item if isinstance(item, str) else item[0]


def split_abort_items(items: Iterable[Any]) -> tuple[list[str], list[str]]:
    """(every request id, the ids whose caller is gone)."""
    ids, gone = [], []
    for item in items:
        if isinstance(item, str):
            ids.append(item)
        else:
            ids.append(item[0])
            gone.append(item[0])
    return ids, gone
