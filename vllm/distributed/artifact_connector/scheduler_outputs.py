# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The output side of the scheduler's Artifact Connector (EngineCore
process): what happens to a finished request once the publishing worker
answers its finalize. The step's terminal outputs of finishing requests are
held; an acknowledgement has the request's routes read off the engine
thread (``route_reader.py``) and, for a request that asked for a
reference, handed out (``route_handoff.py``); the output then leaves with
its routes, or with the typed reason it has none (a publication failure,
or a bound that ran out in the phase it was stuck in). Running requests
whose publication failed are failed here too.

:class:`TerminalOutputs` holds these methods; ``scheduler.py``'s
:class:`~.scheduler.ArtifactSchedulerConnector` (the messages to the
worker and the request lifecycle) builds the state they share and inherits
them, on the engine thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm.distributed.artifact_connector.metrics import ArtifactStatsCollector
from vllm.distributed.artifact_connector.protocol import (
    ACK_TIMEOUT_S,
    READ_TIMEOUT_S,
    ArtifactWorkerReport,
    Release,
)
from vllm.distributed.artifact_connector.request_core import RowsRead, row_versions
from vllm.distributed.artifact_connector.route_handoff import Handoff, RouteHandoff
from vllm.distributed.artifact_connector.route_reader import RouteRead, RouteReader
from vllm.distributed.artifact_connector.route_refs import RouteRefPublishError
from vllm.distributed.artifact_connector.route_results import RouteResults
from vllm.distributed.artifact_connector.scheduler_state import (
    HELD,
    Outbox,
    Phase,
    RequestRecord,
)
from vllm.distributed.artifact_connector.store import ArtifactError
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.distributed.artifact_connector.mooncake.external_hits import (
        ExternalHits,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.request import Request
    from vllm_host_transport.routed_experts import RoutedExpertsRef

logger = init_logger(__name__)

# How long an empty step waits for the reads and hand-offs of the requests
# it holds (the worker's empty steps wait as long for acknowledgements).
EMPTY_STEP_WAIT_S = 0.05


class ArtifactAckTimeout(ArtifactError):
    """The publishing worker did not acknowledge a finished request in time."""


class ArtifactReadTimeout(ArtifactError):
    """The route reader did not read a finished request's routes in time."""


class TerminalOutputs:
    """See the module docs. The state below is built by the subclass."""

    _records: dict[str, RequestRecord]
    # Held records (FINISHING, READING or HANDING_OFF).
    _num_finishing: int
    _out: Outbox
    # Terminal outputs to emit with the next update.
    _ready: list[tuple[int, EngineCoreOutput]]
    _stats: ArtifactStatsCollector
    _results: RouteResults
    _reads: RouteReader
    _handoff: RouteHandoff
    _external: ExternalHits | None
    _kv_cache_manager: KVCacheManager | None
    # Whether this step schedules nothing (build_meta sets it).
    _step_empty: bool

    def update_from_output(
        self,
        report: ArtifactWorkerReport | None,
        outputs: dict[int, list[EngineCoreOutput]],
        finish_requests: Callable[[list[str], Any], list[Request]],
    ) -> None:
        """Hold this step's terminal outputs of finishing requests, read
        acknowledged requests' routes and emit their outputs, fail running
        requests whose publication failed."""
        from vllm.v1.engine import EngineCoreOutput, FinishReason
        from vllm.v1.request import RequestStatus

        self._hold_terminal_outputs(outputs)
        stats = self._stats
        to_fail: dict[str, str] = {}
        now = time.monotonic()
        if report is not None:
            if report.stats is not None:
                stats.worker_snapshot(report.stats)
            if report.pulled and self._external is not None:
                self._external.pulled(report.pulled)
            reads = []
            for ack in report.acks:
                record = self._finishing(ack.req_id, ack.attempt)
                if record is None:
                    self._out.releases.append(Release(ack.req_id, ack.attempt))
                    continue
                stats.publish_s.append(now - record.ended)
                if not record.routes_wanted:
                    self._out.releases.append(Release(ack.req_id, ack.attempt))
                    self._emit(record, None, None)
                    continue
                # The objects stay retained until the read is done. They may
                # end past the boundary (a block a step scheduled before the
                # finish completed): cut there.
                record.phase = Phase.READING
                record.deadline = now + READ_TIMEOUT_S
                if record.as_ref:
                    record.weight_version = row_versions(ack.refs.weight_versions)
                reads.append(
                    RouteRead(
                        ack.req_id,
                        ack.attempt,
                        RowsRead(ack.refs, ack.num_rows, record.first_row),
                        min(record.num_rows, ack.num_rows),
                    )
                )
            self._reads.submit(reads)
            for failure in report.failures:
                error = f"{failure.error_type}: {failure.message}"
                if failure.lost_block_hash is not None:
                    self._forget_prefix_block(failure.lost_block_hash)
                record = self._finishing(failure.req_id, failure.attempt)
                if record is not None:
                    stats.publish_s.append(now - record.ended)
                    self._emit(record, None, error)
                    continue
                record = self._records.get(failure.req_id)
                if record is None:
                    continue
                if (
                    record.parked is not None
                    and record.parked.number == failure.attempt
                ):
                    record.parked = None  # the resumed attempt recomputes it
                elif record.live is not None and record.live.number == failure.attempt:
                    record.live = None
                    record.error = error
                    to_fail[failure.req_id] = error
        self._take_results()
        if self._num_finishing:
            for record in list(self._records.values()):
                if record.phase in HELD and now > record.deadline:
                    self._expire(record, now)
        for client_index, output in self._ready:
            outputs[client_index].append(output)
        self._ready.clear()
        if to_fail:
            for request in finish_requests(list(to_fail), RequestStatus.FINISHED_ERROR):
                stats.request_done(to_fail[request.request_id])
                outputs[request.client_index].append(
                    EngineCoreOutput(
                        request_id=request.request_id,
                        new_token_ids=[],
                        finish_reason=FinishReason.ERROR,
                        trace_headers=request.trace_headers,
                        artifact_error=to_fail[request.request_id],
                    )
                )

    def _take_results(self) -> None:
        results = self._results
        # Held records wait for an acknowledgement (FINISHING), a read
        # (READING) or a hand-off (HANDING_OFF), one pending result each in
        # the last two: none waits for an ack when all are pending.
        if (
            self._step_empty
            and results.pending
            and results.pending == self._num_finishing
        ):
            # Nothing to schedule and nothing but results to wait for: wait
            # for them, so that the outputs leave with this step (a finishing
            # batch's last step) instead of after more empty ones; a request
            # arriving meanwhile waits at most EMPTY_STEP_WAIT_S.
            results.wait_all(EMPTY_STEP_WAIT_S)
        handoffs = []
        for res in results.take():
            record = self._records.get(res.req_id)
            phase = Phase.HANDING_OFF if res.handed_off else Phase.READING
            if record is None or record.phase is not phase:
                # Its deadline passed (the objects were released then): a
                # reference nobody gets is removed now.
                if res.ref is not None:
                    self._handoff.retire(res.ref.key)
                continue
            if res.handed_off:
                self._stats.materialization_s.append(record.read_s + res.seconds)
                self._emit(record, None, res.error, ref=res.ref)
                continue
            # Read: the objects are not needed any more.
            self._out.releases.append(Release(res.req_id, res.attempt))
            if res.error is None and record.as_ref:
                assert res.rows is not None
                record.phase = Phase.HANDING_OFF
                record.read_s = res.seconds
                record.deadline = time.monotonic() + self._handoff.timeout_s
                handoffs.append(
                    Handoff(
                        res.req_id,
                        res.attempt,
                        res.rows,
                        record.first_row,
                        record.deadline,
                        record.weight_version,
                    )
                )
                continue
            self._stats.materialization_s.append(res.seconds)
            self._emit(record, res.rows, res.error)
        self._handoff.submit(handoffs)

    def _expire(self, record: RequestRecord, now: float) -> None:
        """A held request's bound ran out: it leaves without routes, with the
        typed reason of the phase it was stuck in, and releases what it
        holds."""
        error: ArtifactError
        if record.phase is Phase.FINISHING:
            self._stats.publish_s.append(now - record.ended)
            error = ArtifactAckTimeout(
                f"no acknowledgement of request {record.req_id} from the "
                f"publishing worker within {ACK_TIMEOUT_S:g} s"
            )
        elif record.phase is Phase.READING:
            self._out.releases.append(Release(record.req_id, record.finalized))
            self._results.abandon(record.req_id, record.finalized, False)
            error = ArtifactReadTimeout(
                f"the route reader did not read the routes of request "
                f"{record.req_id} within {READ_TIMEOUT_S:g} s"
            )
        else:
            self._results.abandon(record.req_id, record.finalized, True)
            error = RouteRefPublishError(
                f"the routes of request {record.req_id} were not handed out "
                f"by reference within ref_handoff_timeout_s "
                f"({self._handoff.timeout_s:g} s); the reference transport is "
                "slow or down"
            )
        logger.error("%s", error)
        self._emit(record, None, f"{type(error).__name__}: {error}")

    def _forget_prefix_block(self, block_hash: bytes) -> None:
        """A prefix hit found this block's routes gone (evicted from the
        store while its KV stayed cached, or removed behind the engine):
        drop the block from the prefix cache, so that only the request that
        found out fails and the next one recomputes the block. The KV cache
        still decides every hit; R3 only makes it forget blocks it cannot
        serve routes for."""
        manager = self._kv_cache_manager
        if manager is None:
            return
        pool = manager.block_pool
        groups = list(range(manager.num_kv_cache_groups))
        blocks = pool.get_cached_block(block_hash, groups)  # type: ignore[arg-type]
        if blocks:
            pool.evict_blocks({b.block_id for b in blocks})
            logger.warning(
                "routes of a prefix-cache block were lost; the block leaves "
                "the prefix cache and is recomputed by the next request"
            )

    def _hold_terminal_outputs(
        self, outputs: dict[int, list[EngineCoreOutput]]
    ) -> None:
        """Take the terminal outputs of requests that finished in the engine
        this step out of ``outputs``: they leave with their routes."""
        records = self._records
        for client_outputs in outputs.values():
            kept = []
            for eco in client_outputs:
                record = (
                    records.get(eco.request_id)
                    if eco.finish_reason is not None
                    else None
                )
                if record is None or record.phase not in HELD:
                    kept.append(eco)
                elif record.finalized == 0:  # no attempt can give routes
                    self._emit(record, None, record.error, eco)
                else:
                    record.output = eco
            if len(kept) != len(client_outputs):
                client_outputs[:] = kept

    def _finishing(self, req_id: str, attempt: int) -> RequestRecord | None:
        record = self._records.get(req_id)
        if (
            record is None
            or record.phase is not Phase.FINISHING
            or record.finalized != attempt
        ):
            return None
        return record

    def _emit(
        self,
        record: RequestRecord,
        rows: np.ndarray | None,
        error: str | None,
        output: EngineCoreOutput | None = None,
        *,
        ref: RoutedExpertsRef | None = None,
    ) -> None:
        from vllm.v1.engine import FinishReason

        del self._records[record.req_id]
        self._num_finishing -= 1
        output = output or record.output
        if output is None:  # an engine finish whose output never came
            from vllm.v1.engine import EngineCoreOutput

            output = EngineCoreOutput(
                request_id=record.req_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
            )
        if error is not None:
            output.routed_experts = None
            output.artifact_error = error
            if record.engine_finish:
                output.finish_reason = FinishReason.ERROR
        else:
            output.routed_experts = rows
            output.routed_experts_ref = ref
        if record.routes_wanted:
            self._stats.request_done(error)
        self._ready.append((record.client_index, output))
