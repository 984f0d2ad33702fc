# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Artifact Connector in the engine: a scheduler side and a worker side,
split like the KV connector's, talking through ``SchedulerOutput.artifact_meta``
and ``ModelRunnerOutput.artifact_report``.

Scheduler side (:class:`ArtifactSchedulerConnector`, in the EngineCore
process): tells the publishing worker when a request attempt starts (with
the prefix-hit block hashes to retain), which block hashes became known and
where each request ended (finish, or abort at the executed boundary). It
holds a finished request's terminal output until the worker acknowledges
the finish, reads the rows from the store, attaches them and releases the
request's objects. No rows travel per step.

Worker side (:class:`ArtifactWorkerConnector`, in every worker): binds the
capture hooks on every tensor-parallel rank; on the first rank it owns the
store, the row slab and the publisher, feeds each step's captured rows to
the publisher and reports acknowledgements back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from copy import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.config.artifact import routed_experts_row_spec
from vllm.distributed.artifact_connector.buffer import RowSlab
from vllm.distributed.artifact_connector.metrics import (
    STATS_INTERVAL_S,
    ArtifactStatsCollector,
)
from vllm.distributed.artifact_connector.protocol import (
    Abort,
    ArtifactSchedulerMeta,
    ArtifactWorkerReport,
    AttemptStart,
    BlockHashes,
    Discard,
    Finalize,
    Release,
)
from vllm.distributed.artifact_connector.publisher import ArtifactPublisher
from vllm.distributed.artifact_connector.request_core import (
    KeySpace,
    read_rows,
    tail_block_hash,
)
from vllm.distributed.artifact_connector.shm import ShmStoreReader, ShmStoreWriter
from vllm.distributed.artifact_connector.store import ArtifactError
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.worker.gpu.input_batch import InputBatch

logger = init_logger(__name__)

AttemptId = tuple[str, int]

# How long the scheduler waits for a finish's acknowledgement before it
# fails the request instead of hanging the engine.
ACK_TIMEOUT_S = 60.0
# How long an empty step waits for acknowledgements still being published
# (the engine has nothing else to run meanwhile).
EMPTY_STEP_WAIT_S = 0.05
# Steps the publisher may queue before flush() waits (back-pressure).
MAX_QUEUED_STEPS = 4


class ArtifactAckTimeout(ArtifactError):
    """The publishing worker did not acknowledge a finished request in time."""


# ======================================================================
# Scheduler side
# ======================================================================
@dataclass
class _Live:
    """The current attempt of a running request."""

    attempt: int
    hashes_sent: int
    error: str | None = None  # the attempt cannot produce routes


@dataclass
class _Awaiting:
    """A finish or abort sent to the worker, its acknowledgement not read."""

    req_id: str
    client_index: int
    num_rows: int  # rows [0, num_rows) belong to the returned tokens
    first_row: int
    engine_finish: bool  # the request stopped in the engine (output held)
    ended: float  # time.monotonic() when the finish or abort was queued
    output: EngineCoreOutput | None = None


class ArtifactSchedulerConnector:
    """Scheduler side; see the module docs."""

    def __init__(self, vllm_config: VllmConfig, hash_block_size: int) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name

        cfg = vllm_config.artifact_config
        self.spec = routed_experts_row_spec(vllm_config)
        self.block_size = hash_block_size
        self._hash_fn = get_hash_fn_by_name(
            vllm_config.cache_config.prefix_caching_hash_algo
        )
        namespace = cfg.namespace(vllm_config.parallel_config.data_parallel_rank)
        # The workers (and the store's writer) exist before the scheduler.
        self._reader = ShmStoreReader(cfg.shm_root, namespace)
        self._attempt_counts: dict[str, int] = {}
        self._live: dict[str, _Live] = {}
        self._awaiting: dict[AttemptId, _Awaiting] = {}
        self._awaiting_by_req: dict[str, AttemptId] = {}
        # Preempted attempts, kept until the request resumes (a new attempt)
        # or finishes first: with async scheduling an output already in
        # flight can finish a preempted request, and its rows are those of
        # the preempted attempt.
        self._preempted: dict[str, _Live] = {}
        # Requests that stopped in the engine but cannot get routes.
        self._finish_errors: dict[str, str] = {}
        # Outputs to emit with the next update (no acknowledgement needed).
        self._ready: list[tuple[int, EngineCoreOutput]] = []
        # Messages for the next step's meta.
        self._starts: list[AttemptStart] = []
        self._hashes: list[BlockHashes] = []
        self._finalizes: list[Finalize] = []
        self._discards: list[Discard] = []
        self._releases: list[Release] = []
        self._weight_version: str | None = None
        self._stats = ArtifactStatsCollector()

    # ------------------------------------------------------------ messages
    def build_meta(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> ArtifactSchedulerMeta:
        """This step's messages for the publishing worker (every step, empty
        ones included)."""
        bs = self.block_size
        for new in scheduler_output.scheduled_new_reqs:
            req_id = new.req_id
            request = requests[req_id]
            attempt = self._attempt_counts.get(req_id, 0) + 1
            self._attempt_counts[req_id] = attempt
            old = self._preempted.pop(req_id, None)
            if old is not None and old.error is None:
                self._discards.append(Discard(req_id, old.attempt))
            cached = new.num_computed_tokens
            if cached % bs:
                self._live[req_id] = _Live(
                    attempt,
                    0,
                    error=(
                        f"CoverageError: {cached} tokens came from the KV cache, "
                        f"not a multiple of the hash block size {bs}: a KV "
                        "connector loaded a partial block, whose routes are "
                        "not stored"
                    ),
                )
                continue
            n_prefix = cached // bs
            self._starts.append(
                AttemptStart(
                    req_id, attempt, cached, tuple(request.block_hashes[:n_prefix])
                )
            )
            self._live[req_id] = _Live(attempt, n_prefix)
        for req_id, live in self._live.items():
            if live.error is None:
                self._queue_hashes(req_id, live, requests[req_id].block_hashes)
        meta = ArtifactSchedulerMeta(
            weight_version=self._weight_version,
            starts=tuple(self._starts),
            hashes=tuple(self._hashes),
            finalizes=tuple(self._finalizes),
            discards=tuple(self._discards),
            releases=tuple(self._releases),
        )
        self._weight_version = None
        self._starts.clear()
        self._hashes.clear()
        self._finalizes.clear()
        self._discards.clear()
        self._releases.clear()
        return meta

    def _queue_hashes(self, req_id: str, live: _Live, block_hashes: list) -> None:
        n = len(block_hashes)
        if n > live.hashes_sent:
            self._hashes.append(
                BlockHashes(
                    req_id,
                    live.attempt,
                    live.hashes_sent,
                    tuple(block_hashes[live.hashes_sent : n]),
                )
            )
            live.hashes_sent = n

    def set_weight_version(self, version: str) -> None:
        """Rows computed from the next step on belong to ``version``."""
        self._weight_version = version

    # ------------------------------------------------------------ lifecycle
    def on_preempt(self, request: Request) -> None:
        """The request resumes later as a new attempt that recomputes from
        its cached length; the preempted attempt is discarded then (or
        finalized, if the request finishes first)."""
        live = self._live.pop(request.request_id, None)
        if live is not None:
            self._preempted[request.request_id] = live

    def on_finish(self, request: Request) -> None:
        """The request left the scheduler (any reason)."""
        from vllm.v1.engine import EngineCoreOutput, FinishReason
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        live = self._live.pop(req_id, None) or self._preempted.pop(req_id, None)
        self._attempt_counts.pop(req_id, None)
        status = request.status
        num_executed = request.num_tokens - 1
        engine_finish = status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_REPETITION,
        )
        if not engine_finish and not (
            status == RequestStatus.FINISHED_ABORTED and request.num_output_tokens
        ):
            # An error, or aborted before any token was returned: no routes.
            if live is not None and live.error is None:
                self._discards.append(Discard(req_id, live.attempt))
            return
        # An abort is a finish at the executed boundary: every token the
        # engine appended was already sent to the frontend (late tokens of
        # an aborted request are dropped), so the routes cover exactly the
        # returned tokens. The frontend cuts them further at a stop string.
        num_rows = num_executed
        first_row = min(request.sampling_params.routed_experts_prompt_start, num_rows)  # type: ignore[union-attr]
        entry = _Awaiting(
            req_id,
            request.client_index,
            num_rows,
            first_row,
            engine_finish,
            time.monotonic(),
        )
        if not engine_finish:
            # finish_requests() emits nothing for aborts; this output carries
            # the routes (a caller still waiting uses it, others drop it).
            entry.output = EngineCoreOutput(
                request_id=req_id,
                new_token_ids=[],
                finish_reason=FinishReason.ABORT,
                trace_headers=request.trace_headers,
            )
        if live is None or live.error is not None:
            error = (
                "ArtifactError: the request never ran, so no routes cover its tokens"
            )
            if live is not None and live.error is not None:
                error = live.error
            if engine_finish:  # hold() attaches it to the terminal output
                self._finish_errors[req_id] = error
            else:
                self._emit(entry, None, error)
            return
        self._queue_hashes(req_id, live, request.block_hashes)
        bs = self.block_size
        full = num_rows // bs
        tail_hash = None
        if num_rows % bs:
            from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

            extra, _ = generate_block_hash_extra_keys(request, full * bs, num_rows, 0)
            tail_hash = tail_block_hash(
                self._hash_fn,
                request.block_hashes[full - 1] if full else None,
                request.all_token_ids[full * bs : num_rows],
                extra,
            )
        kind = Finalize if engine_finish else Abort
        self._finalizes.append(kind(req_id, live.attempt, num_rows, tail_hash))
        aid = (req_id, live.attempt)
        self._awaiting[aid] = entry
        self._awaiting_by_req[req_id] = aid

    def hold(self, output: EngineCoreOutput) -> bool:
        """Keep a finished request's terminal output until its routes are
        read; returns whether it is held."""
        from vllm.v1.engine import FinishReason

        error = self._finish_errors.pop(output.request_id, None)
        if error is not None:
            output.finish_reason = FinishReason.ERROR
            output.artifact_error = error
            self._stats.request_done(error)
            return False
        aid = self._awaiting_by_req.get(output.request_id)
        if aid is None:
            return False
        self._awaiting[aid].output = output
        return True

    def owes_output(self, req_id: str) -> bool:
        """Whether the connector emits this finished request's terminal
        output (with its routes) itself."""
        return req_id in self._awaiting_by_req or any(
            o.request_id == req_id for _, o in self._ready
        )

    def has_pending(self) -> bool:
        """Whether outputs wait for acknowledgements, or releases for the
        worker: keeps the engine stepping (empty steps included) until they
        are emitted and sent, so an idle engine retains nothing."""
        return bool(self._awaiting or self._ready or self._releases or self._discards)

    # ------------------------------------------------------------ outputs
    def update_from_output(
        self,
        report: ArtifactWorkerReport | None,
        outputs: dict[int, list[EngineCoreOutput]],
        finish_requests: Callable[[list[str], Any], list[Request]],
    ) -> None:
        """Read acknowledged requests' routes and emit their outputs; fail
        running requests whose publication failed."""
        from vllm.v1.engine import EngineCoreOutput, FinishReason
        from vllm.v1.request import RequestStatus

        stats = self._stats
        to_fail: dict[str, str] = {}
        now = time.monotonic()
        if report is not None:
            if report.stats is not None:
                stats.worker_snapshot(report.stats)
            for ack in report.acks:
                aid = (ack.req_id, ack.attempt)
                entry = self._pop_awaiting(aid)
                self._releases.append(Release(*aid))
                if entry is None:
                    continue
                stats.publish_s.append(now - entry.ended)
                start = time.perf_counter()
                rows, error = None, None
                try:
                    end = min(entry.num_rows, ack.num_rows)
                    rows = read_rows(
                        self._reader,
                        self.spec,
                        ack.refs,
                        ack.num_rows,
                        first_row=entry.first_row,
                    )[: end - entry.first_row]
                except ArtifactError as e:
                    logger.warning("routes of request %s unreadable: %s", aid[0], e)
                    error = f"{type(e).__name__}: {e}"
                stats.materialization_s.append(time.perf_counter() - start)
                self._emit(entry, rows, error)
            for failure in report.failures:
                aid = (failure.req_id, failure.attempt)
                error = f"{failure.error_type}: {failure.message}"
                entry = self._pop_awaiting(aid)
                if entry is not None:
                    stats.publish_s.append(now - entry.ended)
                    self._emit(entry, None, error)
                    continue
                live = self._live.get(failure.req_id)
                if live is not None and live.attempt == failure.attempt:
                    to_fail[failure.req_id] = error
        for aid, entry in list(self._awaiting.items()):
            if now - entry.ended > ACK_TIMEOUT_S:
                self._pop_awaiting(aid)
                stats.publish_s.append(now - entry.ended)
                timeout = ArtifactAckTimeout(
                    f"no acknowledgement of request {aid[0]} from the publishing "
                    f"worker within {ACK_TIMEOUT_S:g} s"
                )
                logger.error("%s", timeout)
                self._emit(entry, None, f"{type(timeout).__name__}: {timeout}")
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

    def _pop_awaiting(self, aid: AttemptId) -> _Awaiting | None:
        entry = self._awaiting.pop(aid, None)
        if entry is not None:
            del self._awaiting_by_req[entry.req_id]
        return entry

    def _emit(
        self, entry: _Awaiting, rows: np.ndarray | None, error: str | None
    ) -> None:
        from vllm.v1.engine import FinishReason

        output = entry.output
        if output is None:  # the engine built no terminal output to hold
            from vllm.v1.engine import EngineCoreOutput

            entry.output = output = EngineCoreOutput(
                request_id=entry.req_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
            )
        if error is not None:
            output.routed_experts = None
            output.artifact_error = error
            if entry.engine_finish:
                output.finish_reason = FinishReason.ERROR
        else:
            output.routed_experts = rows
        self._stats.request_done(error)
        self._ready.append((entry.client_index, output))

    def take_stats(self) -> dict[str, Any] | None:
        """The metrics since the last call, for ``SchedulerStats.
        artifact_stats`` (see ``metrics.py``); None when nothing changed.
        Called once per step."""
        return self._stats.take()

    def close(self) -> None:
        self._reader.close()


# ======================================================================
# Worker side
# ======================================================================
class PendingArtifactStep:
    """One step's captured rows on their way to the host: built on the main
    thread (which attempt each request belongs to *now*, so late rows never
    land in a newer attempt), copied on the output copy stream, processed
    where Model Runner V2 produces the step's output."""

    def __init__(
        self,
        connector: ArtifactWorkerConnector,
        attempts: list[AttemptId],
        starts: np.ndarray,
        query_start_loc: np.ndarray,
        device_rows: torch.Tensor,
    ) -> None:
        self.connector = connector
        self.attempts = attempts
        self.starts = starts
        self.query_start_loc = query_start_loc
        self.device_rows = device_rows
        self.rows: np.ndarray | None = None
        self.num_rejected: np.ndarray | None = None

    def enqueue_cpu_copy(self, num_rejected: np.ndarray) -> None:
        """Start the device-to-host copy; call on the output copy stream."""
        self.num_rejected = num_rejected
        self.rows = self.device_rows.to("cpu", non_blocking=True).numpy()

    def process(self) -> ArtifactWorkerReport | None:
        """After the copy completed: publish the rows, report what is done."""
        return self.connector.process(self)


class ArtifactWorkerConnector:
    """Worker side; see the module docs. ``publisher`` is None except on the
    first tensor-parallel rank."""

    def __init__(self, capture: Any, publisher: ArtifactPublisher | None) -> None:
        self._capture = capture
        self._publisher = publisher
        # Main thread: the current attempt of each request.
        self._attempt_of: dict[str, int] = {}
        # Shared with the output thread.
        self._lock = threading.Lock()
        self._awaiting: set[AttemptId] = set()
        self._ended: set[AttemptId] = set()
        # Output thread: per attempt, (rows end, scheduled end) of its last
        # step, to re-attach after rejected speculative tokens.
        self._row_end: dict[AttemptId, tuple[int, int]] = {}
        # The store's counters for the metrics: when they are due next, the
        # last ones sent, and whether the last meta let attempts go (the
        # next empty step reports the store once that is done).
        self._stats_due = 0.0
        self._stats_sent: dict[str, int] | None = None
        self._settle = False

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
    ) -> ArtifactWorkerConnector:
        from vllm.distributed.parallel_state import get_tp_group
        from vllm.model_executor.layers.fused_moe.routed_experts_capture import (
            CaptureState,
        )
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        spec = routed_experts_row_spec(vllm_config)
        capture = CaptureState(model, vllm_config, spec)
        if not get_tp_group().is_first_rank:
            return cls(capture, None)
        cfg = vllm_config.artifact_config
        sched = vllm_config.scheduler_config
        _, block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        namespace = cfg.namespace(vllm_config.parallel_config.data_parallel_rank)
        writer = ShmStoreWriter(
            cfg.shm_root,
            namespace,
            capacity_bytes=cfg.capacity_bytes,
            inactive_ttl_s=cfg.inactive_ttl_s,
        )
        try:
            slab = RowSlab.for_scheduler(
                spec,
                block_size,
                max_num_seqs=sched.max_num_seqs,
                max_num_batched_tokens=sched.max_num_batched_tokens,
                steps_in_flight=vllm_config.max_concurrent_batches
                + MAX_QUEUED_STEPS
                + 1,
            )
            publisher = ArtifactPublisher(
                writer,
                spec,
                slab,
                KeySpace(namespace),
                max_queued_steps=MAX_QUEUED_STEPS,
            )
        except BaseException:
            writer.close()
            raise
        logger.info(
            "Routed experts: %s rows of %s, store %s/%s (%.1f GiB), row slab %.1f MiB",
            spec.dtype,
            list(spec.row_shape),
            cfg.shm_root,
            namespace,
            cfg.capacity_bytes / (1 << 30),
            slab.nbytes / (1 << 20),
        )
        return cls(capture, publisher)

    def begin_step(self, meta: ArtifactSchedulerMeta | None) -> None:
        """Take the scheduler's messages for this step (main thread)."""
        publisher = self._publisher
        if publisher is None or meta is None:
            return
        attempt_of = self._attempt_of
        for s in meta.starts:
            attempt_of[s.req_id] = s.attempt
        ended = [(f.req_id, f.attempt) for f in meta.finalizes]
        ended += [(d.req_id, d.attempt) for d in meta.discards]
        for req_id, attempt in ended:
            if attempt_of.get(req_id) == attempt:
                del attempt_of[req_id]
        with self._lock:
            self._ended.update(ended)
            self._awaiting.update((f.req_id, f.attempt) for f in meta.finalizes)
        if meta.releases or meta.discards:
            self._settle = True
        publisher.apply(meta)
        publisher.flush()

    def prepare_step(self, input_batch: InputBatch) -> PendingArtifactStep | None:
        """Snapshot this step's rows (main thread, after the forward)."""
        if self._publisher is None:
            return None
        req_ids = input_batch.req_ids
        n = len(req_ids)
        qsl = input_batch.query_start_loc_np[: n + 1].copy()
        attempt_of = self._attempt_of
        return PendingArtifactStep(
            self,
            [(r, attempt_of.get(r, -1)) for r in req_ids],
            input_batch.num_computed_tokens_np[:n].copy(),
            qsl,
            self._capture.snapshot(int(qsl[-1])),
        )

    def process(self, step: PendingArtifactStep) -> ArtifactWorkerReport | None:
        publisher = self._publisher
        assert publisher is not None and step.rows is not None
        assert step.num_rejected is not None
        qsl = step.query_start_loc
        scheduled = np.diff(qsl)
        rejected = step.num_rejected[: len(scheduled)]
        counts = scheduled - rejected
        # Rows of rejected speculative tokens are dropped; prefill chunks
        # keep all of theirs.
        rows = step.rows
        if rejected.any():
            rows = np.concatenate(
                [rows[lo : lo + c] for lo, c in zip(qsl[:-1], counts)]
            )
        starts = step.starts.tolist()
        with self._lock:
            ended = set(self._ended)
        row_end, new_end = self._row_end, {}
        for i, (aid, start, n, c) in enumerate(
            zip(step.attempts, starts, scheduled.tolist(), counts.tolist())
        ):
            prev = row_end.get(aid)
            if prev is not None and prev[0] < start <= prev[1]:
                # The scheduler placed this step after the previous one's
                # draft tokens, some of which were rejected.
                start = starts[i] = prev[0]
            new_end[aid] = (start + c, start + n)
        for aid, ends in row_end.items():
            if aid not in new_end and aid not in ended:
                new_end[aid] = ends
        self._row_end = new_end
        with self._lock:
            self._ended -= ended - new_end.keys()
        publisher.write_step(step.attempts, starts, counts.tolist(), rows)
        publisher.flush()
        return self._take_report()

    def no_forward(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """An empty step still carries acknowledgements, so a finished
        request's output is never stranded when nothing else runs."""
        publisher = self._publisher
        if publisher is None:
            return output
        with self._lock:
            awaiting = list(self._awaiting)
        if awaiting:
            publisher.wait_for_results(awaiting, EMPTY_STEP_WAIT_S)
        settle, self._settle = self._settle, False
        if settle:
            # The engine may go idle after this step: let the releases just
            # handed over finish, so the metrics show the store at rest.
            with contextlib.suppress(TimeoutError):
                publisher.wait_idle(EMPTY_STEP_WAIT_S)
        report = self._take_report(stats_now=settle)
        if report is None:
            return output
        output = copy(output)  # the empty output is a shared singleton
        output.artifact_report = report
        return output

    def _take_report(self, stats_now: bool = False) -> ArtifactWorkerReport | None:
        publisher = self._publisher
        assert publisher is not None
        report = publisher.report()
        now = time.monotonic()
        if stats_now or now >= self._stats_due:
            stats = publisher.metrics()
            self._stats_due = now + STATS_INTERVAL_S
            if stats != self._stats_sent:
                self._stats_sent = stats
                report = dataclasses.replace(report, stats=stats)
        if report.is_empty():
            return None
        done = [(a.req_id, a.attempt) for a in report.acks]
        done += [(f.req_id, f.attempt) for f in report.failures]
        with self._lock:
            self._awaiting.difference_update(done)
        return report

    def stats(self) -> dict[str, int]:
        """Store counters, attempts alive and row-slab pages in use; empty
        on ranks that do not publish."""
        return {} if self._publisher is None else self._publisher.stats()

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None


# ======================================================================
# Frontend
# ======================================================================
def remove_dead_stores(vllm_config: VllmConfig, wait_s: float = 5.0) -> None:
    """Called by the frontend once its engine processes are stopped. A
    shutdown may kill them before the worker removes its store (``vllm
    serve`` on SIGINT does): remove the stores under the root whose writer is
    proven dead, waiting up to ``wait_s`` for this engine's killed workers to
    be gone, and the root when that leaves it empty. Live engines' stores are
    never touched."""
    import os

    from vllm.distributed.artifact_connector.shm import collect_stale_stores

    cfg = vllm_config.artifact_config
    if not cfg.enable_routed_experts:
        return
    ours = {
        cfg.namespace(rank)
        for rank in range(vllm_config.parallel_config.data_parallel_size)
    }
    deadline = time.monotonic() + wait_s
    while True:
        try:
            report = collect_stale_stores(cfg.shm_root, cfg.inactive_ttl_s)
        except (ArtifactError, OSError) as e:
            logger.warning("could not clean up the artifact store root: %s", e)
            return
        if report.removed:
            logger.info("removed artifact stores of dead engines: %s", report.removed)
        if not ours & set(report.kept_alive) or time.monotonic() > deadline:
            break
        time.sleep(0.1)  # a killed worker is still exiting
    with contextlib.suppress(OSError):
        os.rmdir(cfg.shm_root)
