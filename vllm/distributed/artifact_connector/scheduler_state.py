# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler side's state: one :class:`RequestRecord` per request (its
:class:`Phase`, live and parked attempts, how it ends) and the
:class:`Outbox` of messages for the next step's meta. The transitions are
the scheduler connector's (``scheduler.py``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.artifact_connector.protocol import (
    ArtifactSchedulerMeta,
    AttemptStart,
    BlockHashes,
    Discard,
    Finalize,
    PullRoutes,
    Release,
)

if TYPE_CHECKING:
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.request import Request


class Phase(enum.Enum):
    RUNNING = "running"
    """The live attempt is scheduled (or waits to be, before its first step)."""
    PREEMPTED = "preempted"
    """Preempted: the attempt keeps its rows until the request resumes and
    the new attempt has recomputed them, or until it finishes first."""
    FINISHING = "finishing"
    """Finalize sent; the terminal output waits for the acknowledgement."""
    READING = "reading"
    """Acknowledged; the route reader reads the rows, the terminal output
    waits for them."""
    HANDING_OFF = "handing_off"
    """Read and released; the rows are being handed out by reference, the
    terminal output waits for the reference."""


#: The phases in which a finished request's terminal output is held, each
#: until a deadline (``RequestRecord.deadline``).
HELD = (Phase.FINISHING, Phase.READING, Phase.HANDING_OFF)


@dataclass
class AttemptState:
    number: int
    hashes_sent: int
    # Tokens the attempt has computed (scheduled); set when it stops running.
    computed: int = 0


@dataclass
class RequestRecord:
    """One request's R3 state."""

    req_id: str
    client_index: int
    phase: Phase = Phase.RUNNING
    attempts: int = 0  # attempts started so far
    live: AttemptState | None = None
    # A preempted attempt kept while the resumed one recomputes its rows:
    # a finish during the recompute is finalised from it.
    parked: AttemptState | None = None
    # Why this request cannot get routes (it runs and fails when it ends).
    error: str | None = None
    # Whether a caller waits for routes (False after a client-gone abort).
    routes_wanted: bool = True
    # Routes go out by reference (routed_experts_format "ref").
    as_ref: bool = False
    # FINISHING: the finalised attempt, the boundary, the held output.
    finalized: int = 0
    num_rows: int = 0
    first_row: int = 0
    engine_finish: bool = False
    ended: float = 0.0
    # When the held phase's bound runs out (time.monotonic()).
    deadline: float = 0.0
    # The read's reader time, for a request handed out by reference.
    read_s: float = 0.0
    # By reference: the weight versions its rows were computed under.
    weight_version: str = ""
    output: EngineCoreOutput | None = None


@dataclass
class Outbox:
    """Messages for the next step's meta."""

    starts: list[AttemptStart] = field(default_factory=list)
    hashes: list[BlockHashes] = field(default_factory=list)
    finalizes: list[Finalize] = field(default_factory=list)
    discards: list[Discard] = field(default_factory=list)
    releases: list[Release] = field(default_factory=list)
    pulls: list[PullRoutes] = field(default_factory=list)
    weight_version: str | None = None

    def meta(self) -> ArtifactSchedulerMeta:
        return ArtifactSchedulerMeta(
            weight_version=self.weight_version,
            starts=tuple(self.starts),
            hashes=tuple(self.hashes),
            finalizes=tuple(self.finalizes),
            discards=tuple(self.discards),
            releases=tuple(self.releases),
            pulls=tuple(self.pulls),
        )


def ended_in_engine(request: Request) -> bool:
    """Whether the engine itself ended the request (stop token, length,
    repetition), not an abort."""
    from vllm.v1.request import RequestStatus

    return request.status in (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_REPETITION,
    )
