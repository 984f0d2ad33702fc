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
boundary), discards (preemption) and releases (the scheduler has read an
acknowledgement).

Worker -> scheduler (:class:`ArtifactWorkerReport`): commit progress,
finalize acknowledgements with the ordered references of every object that
covers the request, and failures.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    """The attempt ends without output (preemption): drop its unpublished
    rows and release what it retained. Its published objects stay."""

    req_id: str
    attempt: int


@dataclass(frozen=True, slots=True)
class Release:
    """The scheduler has read the attempt's acknowledgement: release the
    objects the attempt retained."""

    req_id: str
    attempt: int


@dataclass(frozen=True, slots=True)
class CommitProgress:
    """Rows ``[0, committed_rows)`` of the attempt are in the store."""

    req_id: str
    attempt: int
    committed_rows: int


@dataclass(frozen=True, slots=True)
class PublishedRef:
    """One object of a request: rows ``[start, start + num_rows)`` under
    ``key``, exact version ``checksum``, computed under ``weight_version``."""

    key: str
    start: int
    num_rows: int
    checksum: int
    weight_version: str


@dataclass(frozen=True, slots=True)
class FinalizeAck:
    """Finalisation done: ``refs`` cover rows ``[0, num_rows)`` in order
    (prefix-hit objects first, then the attempt's own). They are
    authoritative: the scheduler reads exactly these versions, which stay
    retained until it sends :class:`Release`."""

    req_id: str
    attempt: int
    num_rows: int
    refs: tuple[PublishedRef, ...]
    aborted: bool = False


@dataclass(frozen=True, slots=True)
class AttemptFailed:
    """The worker could not publish or finalise an attempt; nothing of it
    stays retained. ``error_type`` is the exception class name, ``message``
    says the cause and the remedy."""

    req_id: str
    attempt: int
    error_type: str
    message: str


@dataclass(frozen=True, slots=True)
class ArtifactSchedulerMeta:
    """Everything the scheduler tells the publishing worker in one step."""

    starts: tuple[AttemptStart, ...] = ()
    hashes: tuple[BlockHashes, ...] = ()
    finalizes: tuple[Finalize, ...] = ()
    discards: tuple[Discard, ...] = ()
    releases: tuple[Release, ...] = ()

    def is_empty(self) -> bool:
        return not (
            self.starts
            or self.hashes
            or self.finalizes
            or self.discards
            or self.releases
        )


@dataclass(frozen=True, slots=True)
class ArtifactWorkerReport:
    """Everything the publishing worker reports back in one step."""

    progress: tuple[CommitProgress, ...] = ()
    acks: tuple[FinalizeAck, ...] = ()
    failures: tuple[AttemptFailed, ...] = ()

    def is_empty(self) -> bool:
        return not (self.progress or self.acks or self.failures)
