# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Scheduler <-> worker messages of the Artifact Connector.

Messages name request *attempts* (request id + attempt number, bumped on
every preemption/resumption), logical row ranges and KV block hashes only:
never physical KV block ids or slots, never file paths. They are frozen
dataclasses of plain types, cheap to pickle and encodable with msgspec
(``msgspec.msgpack.encode`` / ``decode(..., type=...)``), the two
serialisers vLLM uses for ``SchedulerOutput`` and ``ModelRunnerOutput``.

Flow per step:

* scheduler -> worker (:class:`ArtifactSchedulerMeta`): new attempts with
  their cached start, newly known block hashes, finalisations, aborts;
* worker -> scheduler (:class:`ArtifactWorkerReport`): commit progress per
  attempt, finalize ACKs with the ordered object refs this attempt
  published, and failures.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class AttemptStart:
    """An attempt begins; rows ``[0, cached_rows)`` come from the prefix
    cache and rows from ``cached_rows`` on will be computed."""

    req_id: str
    attempt: int
    cached_rows: int


@dataclass(frozen=True, slots=True)
class BlockHashes:
    """KV hashes (hash-block granularity) of full blocks
    ``[first_block, first_block + len(hashes))`` of an attempt."""

    req_id: str
    attempt: int
    first_block: int
    hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Finalize:
    """The request ended with ``num_rows`` rows (``N - 1``); publish what
    is left, including the tail keyed by ``tail_hash`` (``None`` when
    ``num_rows`` is a multiple of the block size), and ACK."""

    req_id: str
    attempt: int
    num_rows: int
    tail_hash: bytes | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    """Drop the attempt's uncommitted rows and any pending finalisation.
    Published objects stay (they are immutable and may serve prefix hits)."""

    req_id: str
    attempt: int


@dataclass(frozen=True, slots=True)
class CommitProgress:
    """Rows ``[0, committed_rows)`` of the attempt are durable in the store."""

    req_id: str
    attempt: int
    committed_rows: int


@dataclass(frozen=True, slots=True)
class PublishedRef:
    """One object an attempt published: rows ``[start, start + num_rows)``
    under ``key``, exact version ``checksum``."""

    key: str
    start: int
    num_rows: int
    checksum: int


@dataclass(frozen=True, slots=True)
class FinalizeAck:
    """Finalisation done: ``refs`` are the objects covering rows
    ``[first_row, num_rows)`` in order (``first_row`` = the attempt's cached
    start, a block boundary). The scheduler reads rows below ``first_row``
    by key from the prefix-hit blocks."""

    req_id: str
    attempt: int
    num_rows: int
    first_row: int
    refs: tuple[PublishedRef, ...]


@dataclass(frozen=True, slots=True)
class AttemptFailed:
    """The worker could not publish or finalise an attempt. ``error_type``
    is the exception class name, ``message`` says the cause and remedy."""

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
    aborts: tuple[Abort, ...] = ()

    def is_empty(self) -> bool:
        return not (self.starts or self.hashes or self.finalizes or self.aborts)


@dataclass(frozen=True, slots=True)
class ArtifactWorkerReport:
    """Everything the publishing worker reports back in one step."""

    progress: tuple[CommitProgress, ...] = ()
    acks: tuple[FinalizeAck, ...] = ()
    failures: tuple[AttemptFailed, ...] = ()
    stats: dict[str, int] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (self.progress or self.acks or self.failures)
