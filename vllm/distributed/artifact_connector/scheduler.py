# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler side of the Artifact Connector (EngineCore process): the
messages to the publishing worker and the request lifecycle.

It tells the publishing worker, through ``SchedulerOutput.artifact_meta``,
when a request attempt starts (with the prefix-hit block hashes to retain),
which block hashes became known, under which weight version and cache epoch
rows are keyed, and how each attempt ends: finalised at the executed
boundary (a finish, or an abort whose caller waits), or discarded (drained:
its full blocks are published, the rest dropped). What happens to a
finished request's terminal output once the worker answers (held until the
acknowledgement in ``ModelRunnerOutput.artifact_report``, its rows read off
the engine thread, attached, its objects released) is the output side,
``scheduler_outputs.py``, whose methods this class inherits.

State is one :class:`RequestRecord` per request, with an explicit
:class:`Phase`; every transition is a method of this class or of its output
side, on the engine thread. No rows travel per step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.config.artifact import (
    check_prefix_caching_for_routed_experts,
    routed_experts_row_spec,
)
from vllm.config.artifact_transfer import loads_shared_kv
from vllm.distributed.artifact_connector.metrics import ArtifactStatsCollector
from vllm.distributed.artifact_connector.protocol import (
    ACK_TIMEOUT_S,
    Abort,
    ArtifactSchedulerMeta,
    AttemptStart,
    BlockHashes,
    Discard,
    Finalize,
    split_abort_items,
)
from vllm.distributed.artifact_connector.request_core import (
    keyed_version,
    tail_block_hash,
)
from vllm.distributed.artifact_connector.route_handoff import RouteHandoff
from vllm.distributed.artifact_connector.route_reader import RouteReader
from vllm.distributed.artifact_connector.route_refs import RouteRefs
from vllm.distributed.artifact_connector.route_results import RouteResults
from vllm.distributed.artifact_connector.scheduler_outputs import TerminalOutputs
from vllm.distributed.artifact_connector.scheduler_state import (
    HELD,
    AttemptState,
    Outbox,
    Phase,
    RequestRecord,
    ended_in_engine,
)
from vllm.distributed.artifact_connector.shm import ShmStoreReader

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.artifact_connector.mooncake.external_hits import (
        ExternalHits,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.request import Request


class ArtifactSchedulerConnector(TerminalOutputs):
    """See the module docs."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        hash_block_size: int,
        kv_cache_manager: KVCacheManager | None = None,
    ) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name

        # The engine core may have turned prefix caching off after the
        # config was verified (models with non-causal layers).
        check_prefix_caching_for_routed_experts(vllm_config)
        cfg = vllm_config.artifact_config
        self.spec = routed_experts_row_spec(vllm_config)
        self.block_size = hash_block_size
        self._hash_fn = get_hash_fn_by_name(
            vllm_config.cache_config.prefix_caching_hash_algo
        )
        namespace = cfg.namespace(vllm_config.parallel_config.data_parallel_rank)
        # The workers (and the store's writer) exist before the scheduler.
        self._default_format = cfg.routed_experts_format
        # Reads and hand-offs by reference on threads of their own; both
        # post here.
        self._results = RouteResults()
        self._reads = RouteReader(
            ShmStoreReader(cfg.shm_root, namespace), self.spec, self._results
        )
        # The reference transport opens when the engine starts, on the
        # hand-off thread: a Mooncake client is never set up while the
        # engine serves, and the host transport's join sweeps the payloads
        # a killed predecessor left in its scope.
        self._handoff = RouteHandoff(
            self._results,
            lambda: RouteRefs(cfg),
            cfg.ref_handoff_timeout_s,
            open_now=True,
        )
        # Keys are derived under keyed_version(weight version, cache epoch).
        self._weight_version = "default"
        self._cache_epoch = 0
        self._version_at_reset = self._weight_version
        # The last ref_versions_kept weight versions: references of older
        # ones are removed when a new one is set.
        self._ref_versions: list[str] = [self._weight_version]
        self._ref_versions_kept = cfg.ref_versions_kept
        self._step_empty = False
        self._records: dict[str, RequestRecord] = {}
        # Where blocks whose routes are lost are dropped from the prefix
        # cache (only when its blocks are the hash blocks).
        self._kv_cache_manager = (
            kv_cache_manager
            if vllm_config.cache_config.block_size == hash_block_size
            else None
        )
        self._num_finishing = 0
        self._out = Outbox()
        # Terminal outputs to emit with the next update.
        self._ready: list[tuple[int, EngineCoreOutput]] = []
        self._stats = ArtifactStatsCollector()
        self._external: ExternalHits | None = None
        if cfg.backend == "mooncake" and loads_shared_kv(
            vllm_config.kv_transfer_config
        ):
            from vllm.distributed.artifact_connector.mooncake import external_hits

            self._external = external_hits.ExternalHits(vllm_config, hash_block_size)

    # ------------------------------------------------------------ messages
    def build_meta(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> ArtifactSchedulerMeta:
        """This step's messages for the publishing worker (every step, empty
        ones included)."""
        for new in scheduler_output.scheduled_new_reqs:
            request = requests[new.req_id]
            record = self._records.get(new.req_id)
            if record is None:
                fmt = (
                    request.sampling_params.routed_experts_format
                    if request.sampling_params is not None
                    else None
                ) or self._default_format
                record = self._records[new.req_id] = RequestRecord(
                    new.req_id, request.client_index, as_ref=fmt == "ref"
                )
            self._start_attempt(record, request, new.num_computed_tokens)
        self._step_empty = scheduler_output.total_num_scheduled_tokens == 0
        # Every running request, every step: kept to a length comparison
        # per request (the base's own block hasher runs per request per step).
        for record in self._records.values():
            live, parked = record.live, record.parked
            if (live is None and parked is None) or record.phase in HELD:
                continue
            request = requests[record.req_id]
            if live is not None and len(request.block_hashes) > live.hashes_sent:
                self._queue_hashes(record, live, request.block_hashes)
            if parked is not None and request.num_computed_tokens >= parked.computed:
                # The resumed attempt has recomputed everything the parked
                # one held: drain the parked one.
                self._discard(record, parked)
                record.parked = None
        if self._external is not None:
            self._out.pulls.extend(self._external.take_pulls())
        # Messages queued from now on go with the next step.
        out, self._out = self._out, Outbox()
        return out.meta()

    def _start_attempt(
        self, record: RequestRecord, request: Request, cached: int
    ) -> None:
        bs = self.block_size
        old = record.live
        if old is not None:
            # A resumed request. Keep the attempt that holds the most rows
            # until the new one has recomputed them; drain the other.
            self._queue_hashes(record, old, request.block_hashes)
            keep, drop = old, record.parked
            if drop is not None and drop.computed > old.computed:
                keep, drop = drop, old
            if drop is not None:
                self._discard(record, drop)
            record.parked = keep if keep.computed > cached else None
            if record.parked is None:
                self._discard(record, keep)
        record.attempts += 1
        record.phase = Phase.RUNNING
        record.live = None
        if record.error is not None:
            return
        if cached % bs:
            record.error = (
                f"CoverageError: {cached} tokens came from the KV cache, not a "
                f"multiple of the hash block size {bs}: a KV connector loaded a "
                "partial block, whose routes are not stored"
            )
            return
        n_prefix = cached // bs
        self._out.starts.append(
            AttemptStart(
                record.req_id,
                record.attempts,
                cached,
                tuple(request.block_hashes[:n_prefix]),
            )
        )
        record.live = AttemptState(record.attempts, n_prefix)

    def _queue_hashes(
        self, record: RequestRecord, att: AttemptState, block_hashes: list
    ) -> None:
        n = len(block_hashes)
        if n > att.hashes_sent:
            self._out.hashes.append(
                BlockHashes(
                    record.req_id,
                    att.number,
                    att.hashes_sent,
                    tuple(block_hashes[att.hashes_sent : n]),
                )
            )
            att.hashes_sent = n

    def _discard(self, record: RequestRecord, att: AttemptState) -> None:
        """End an attempt without output: the worker publishes its full
        blocks (their KV stays cached, later hits need their routes), drops
        the rest and releases what it retained."""
        self._out.discards.append(Discard(record.req_id, att.number, att.computed))

    def set_weight_version(self, version: str) -> None:
        """Rows computed from the next step on belong to ``version``."""
        if version != self._weight_version:
            self._weight_version = version
            self._cache_epoch = 0
            self._retire_ref_versions(version)
        self._send_version()

    def _retire_ref_versions(self, version: str) -> None:
        kept = self._ref_versions_kept
        if not kept:
            return
        versions = [v for v in self._ref_versions if v != version] + [version]
        self._ref_versions = versions[-kept:]
        if len(versions) > kept:
            self._handoff.retire_versions(tuple(self._ref_versions))

    def reset(self) -> None:
        """The prefix cache was reset (after a weight update, in RL loops):
        unless the weight version changed since the previous reset (its new
        keys already tell the weights apart), rows computed from the next
        step on, and the prefix blocks they are read with, get keys of a new
        cache epoch (``request_core.keyed_version``). Engines that reset
        together count alike, so they keep sharing routes."""
        if self._weight_version == self._version_at_reset:
            self._cache_epoch += 1
        self._version_at_reset = self._weight_version
        self._send_version()

    def _send_version(self) -> None:
        version = keyed_version(self._weight_version, self._cache_epoch)
        self._out.weight_version = version
        if self._external is not None:
            self._external.weight_version = version

    def routed_external_tokens(
        self, request: Request, num_local: int, num_external: int
    ) -> int | None:
        """How many of the ``num_external`` tokens a KV connector offers to
        load after ``num_local`` to take: all of them, but from a connector
        that loads KV other engines computed only the leading blocks whose
        routes are in the local store, after a bounded pull from the shared
        tier (``ExternalHits``; None: not yet, skip the request this step);
        the engine recomputes the rest."""
        if self._external is None:
            return num_external
        return self._external.routed_tokens(request, num_local, num_external)

    # ------------------------------------------------------------ lifecycle
    def on_preempt(self, request: Request) -> None:
        """Called before the scheduler frees the request's blocks: the
        attempt keeps its rows (and gets the hashes of blocks its in-flight
        steps complete) until the request resumes or finishes."""
        record = self._records.get(request.request_id)
        if record is None or record.phase is not Phase.RUNNING:
            return
        record.phase = Phase.PREEMPTED
        if record.live is not None:
            record.live.computed = request.num_computed_tokens

    def take_abort_items(self, items: Iterable[Any]) -> list[str]:
        """The request ids of an ABORT payload (``protocol.abort_items``);
        requests whose caller is gone (client disconnects) are marked so
        that, when they end, nothing is read for them."""
        req_ids, gone = split_abort_items(items)
        for req_id in gone:
            record = self._records.get(req_id)
            if record is not None:
                record.routes_wanted = False
        return req_ids

    def on_finish(self, request: Request) -> None:
        """The request left the scheduler (any reason)."""
        from vllm.v1.engine import EngineCoreOutput, FinishReason
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        if self._external is not None:
            self._external.forget(req_id)
        record = self._records.get(req_id)
        if record is None:  # never scheduled
            if ended_in_engine(request) or (
                request.status == RequestStatus.FINISHED_ABORTED
                and request.num_output_tokens
            ):
                # Cannot happen in the base (a request runs before it
                # returns tokens); fail loudly rather than answer without.
                record = self._records[req_id] = RequestRecord(
                    req_id, request.client_index
                )
                record.error = (
                    "ArtifactError: the request never ran, so no routes cover "
                    "its tokens"
                )
            else:
                return
        if record.phase in HELD:
            return
        engine_finish = ended_in_engine(request)
        aborted_with_tokens = (
            request.status == RequestStatus.FINISHED_ABORTED
            and request.num_output_tokens > 0
            and record.routes_wanted
        )
        computed = request.num_computed_tokens
        if record.phase is Phase.RUNNING and record.live is not None:
            record.live.computed = computed
        if not (engine_finish or aborted_with_tokens):
            # An error, aborted before any token, or nobody waits: no output
            # from here; drain every attempt.
            for att in (record.live, record.parked):
                if att is not None:
                    self._queue_hashes(record, att, request.block_hashes)
                    self._discard(record, att)
            del self._records[req_id]
            return
        num_rows = request.num_tokens - 1
        record.phase = Phase.FINISHING
        self._num_finishing += 1
        record.num_rows = num_rows
        record.first_row = min(
            request.sampling_params.routed_experts_prompt_start,  # type: ignore[union-attr]
            num_rows,
        )
        record.engine_finish = engine_finish
        record.ended = time.monotonic()
        record.deadline = record.ended + ACK_TIMEOUT_S
        if not engine_finish:
            # finish_requests() emits nothing for aborts; this output carries
            # the routes to the caller that waits.
            record.output = EngineCoreOutput(
                request_id=req_id,
                new_token_ids=[],
                finish_reason=FinishReason.ABORT,
                trace_headers=request.trace_headers,
            )
        att = self._attempt_for(record, num_rows)
        for other in (record.live, record.parked):
            if other is not None and other is not att:
                self._queue_hashes(record, other, request.block_hashes)
                self._discard(record, other)
        record.live = record.parked = None
        if att is None:
            if record.error is None:
                record.error = (
                    f"CoverageError: no attempt of request {req_id} computed its "
                    f"{num_rows} rows"
                )
            if not engine_finish:
                self._emit(record, None, record.error)
            return  # the engine's terminal output gets the error when it comes
        self._queue_hashes(record, att, request.block_hashes)
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
        self._out.finalizes.append(kind(req_id, att.number, num_rows, tail_hash))
        record.finalized = att.number

    def _attempt_for(self, record: RequestRecord, num_rows: int) -> AttemptState | None:
        """The attempt whose rows cover ``num_rows``: the live one once it
        has computed them, else the parked one it is recomputing."""
        if record.error is not None:
            return None
        live, parked = record.live, record.parked
        if live is not None and (parked is None or live.computed >= num_rows):
            return live
        if parked is not None and parked.computed >= num_rows:
            return parked
        return live

    def owes_output(self, req_id: str) -> bool:
        """Whether the connector emits this finished request's terminal
        output (with its routes) itself."""
        record = self._records.get(req_id)
        return (
            record is not None and record.phase in HELD and not record.engine_finish
        ) or any(o.request_id == req_id for _, o in self._ready)

    def without_owed_outputs(self, aborted: list[Request]) -> list[Request]:
        """The engine core's aborted requests whose abort output it sends
        itself: all but those the connector owes an output with routes
        (it emits them once read; a pause or shutdown completes after)."""
        return [r for r in aborted if not self.owes_output(r.request_id)]

    def has_pending(self) -> bool:
        """Whether outputs wait for acknowledgements, or messages for the
        worker: keeps the engine stepping (empty steps included) until they
        are emitted and sent, so an idle engine retains nothing."""
        out = self._out
        return bool(
            self._ready
            or out.releases
            or out.discards
            or out.finalizes
            or self._num_finishing
        )

    def take_stats(self) -> dict[str, Any] | None:
        """The metrics since the last call, for ``SchedulerStats.
        artifact_stats`` (see ``metrics.py``); None when nothing changed.
        Called once per step."""
        refs = self._handoff.counters()
        if refs is not None:
            self._stats.refs_snapshot(refs)
        return self._stats.take()

    def stats(self) -> dict[str, int]:
        """Records held (tests: zero once the engine is idle)."""
        return {"records": len(self._records), "ready": len(self._ready)}

    def close(self) -> None:
        if self._external is not None:
            self._external.close()
        self._handoff.close()
        self._reads.close()


def artifact_connector_of(scheduler: object) -> ArtifactSchedulerConnector | None:
    """The one way the engine core reaches a scheduler's Artifact Connector:
    vLLM's ``Scheduler`` holds it (``artifact_connector``, patch 0006; None
    when R3 is off), a scheduler class of the user's has none."""
    return getattr(scheduler, "artifact_connector", None)
