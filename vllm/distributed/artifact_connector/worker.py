# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker side of the Artifact Connector (every worker process).

:class:`CaptureState` binds the base's routed-experts capturer to the
model's routers on every tensor-parallel rank (its sequence-parallel branch
all-gathers over the TP group, so every rank must capture). On the first
rank, :class:`ArtifactWorkerConnector` also owns the store, the row slab and
the publisher, and adapts Model Runner V2's hooks to the publisher: the
scheduler's messages before the forward, the step's captured rows after
it, the acknowledgements back. The attempt table lives in the publisher,
under its one lock; this adapter keeps no per-request state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from copy import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.config.artifact import routed_experts_row_spec
from vllm.distributed.artifact_connector.buffer import RowSlab
from vllm.distributed.artifact_connector.metrics import STATS_INTERVAL_S
from vllm.distributed.artifact_connector.protocol import (
    ArtifactSchedulerMeta,
    ArtifactWorkerReport,
)
from vllm.distributed.artifact_connector.publisher import (
    GATHER_OBJECTS,
    ArtifactPublisher,
)
from vllm.distributed.artifact_connector.request_core import KeySpace
from vllm.distributed.artifact_connector.shm import (
    DEFAULT_CAPACITY_BYTES,
    ShmStoreWriter,
)
from vllm.distributed.artifact_connector.store import ObjectStoreWriter
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
    RoutedExpertsCapturer,
    bind_routed_experts_capturer,
)
from vllm.utils.routed_experts_rows import RowSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu.input_batch import InputBatch

logger = init_logger(__name__)

# How long an empty step waits for acknowledgements still being published
# (the engine has nothing else to run meanwhile).
EMPTY_STEP_WAIT_S = 0.05
# Steps the publisher may queue before flush() waits (back-pressure).
MAX_QUEUED_STEPS = 4


class CaptureState:
    """Owns the capture buffer (``[max_num_batched_tokens, num_hidden_layers,
    top_k]`` int32 on the device). Routers write the rows of their layer in
    every forward; layers without a router are never written and stay zero,
    which is the documented value of a dense layer's row."""

    def __init__(
        self, model: torch.nn.Module, vllm_config: VllmConfig, spec: RowSpec
    ) -> None:
        self.spec = spec
        self.capturer = RoutedExpertsCapturer(
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            vllm_config=vllm_config,
        )
        if self.capturer.shape_per_token != spec.row_shape:
            raise ValueError(
                f"routed-experts rows are {spec.row_shape} but the capture "
                f"buffer holds {self.capturer.shape_per_token} per token"
            )
        # torch names the four row dtypes like numpy.
        self._dtype = getattr(torch, spec.dtype.name)
        try:
            bind_routed_experts_capturer(model, self.capturer)
        except ValueError as e:
            raise ValueError(
                f"--enable-routed-experts cannot capture routes of this model: "
                f"{e} Serve it without the flag, or with a MoE kernel that "
                "supports routing capture (e.g. --moe-backend triton)."
            ) from e

    def snapshot(self, num_rows: int) -> torch.Tensor:
        """This step's rows, narrowed to the returned dtype, as a new tensor
        (the next forward overwrites the buffer)."""
        rows = self.capturer.device_buffer[:num_rows]
        if self._dtype == rows.dtype:
            return rows.clone()
        return rows.to(self._dtype)


@dataclass(eq=False)
class PendingArtifactStep:
    """One step's captured rows on their way to the host: built on the main
    thread (which attempt each request belongs to *now*, so late rows never
    land in a newer attempt, and the weight version that computed them),
    copied on the output copy stream, processed where Model Runner V2
    produces the step's output."""

    connector: ArtifactWorkerConnector
    attempts: np.ndarray
    weight_version: str
    starts: np.ndarray
    query_start_loc: np.ndarray
    device_rows: torch.Tensor
    # Set by enqueue_cpu_copy.
    rows: np.ndarray | None = None
    num_rejected: np.ndarray | None = None

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

    def __init__(
        self,
        capture: CaptureState,
        publisher: ArtifactPublisher | None,
        vllm_config: VllmConfig | None = None,
    ):
        self._capture = capture
        self._publisher = publisher
        self._vllm_config = vllm_config
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
        """Both phases at once, once the KV cache config is known (Model
        Runner V2 of vLLM 0.32)."""
        connector = cls.bind(model, vllm_config)
        connector.initialize_storage(kv_cache_config)
        return connector

    @classmethod
    def bind(
        cls,
        model: torch.nn.Module,
        vllm_config: VllmConfig,
        previous: ArtifactWorkerConnector | None = None,
    ) -> ArtifactWorkerConnector:
        """Phase one, on every tensor-parallel rank: bind the capturer to the
        model's routers. Model Runner V2 of vLLM 0.34 calls it in
        profile_run(), before the profiling forward compiles the model, so
        the compiled graph calls the capture hooks. ``previous``: the
        connector of an earlier binding, whose store (if any) carries over."""
        spec = routed_experts_row_spec(vllm_config)
        connector = cls(CaptureState(model, vllm_config, spec), None, vllm_config)
        if previous is not None:
            connector._publisher, previous._publisher = previous._publisher, None
        return connector

    def initialize_storage(self, kv_cache_config: KVCacheConfig) -> None:
        """Phase two, once the KV cache config is known (the store keys
        objects by hash block): on the first tensor-parallel rank, the
        store, the row slab and the publisher. Called again, it replaces
        them."""
        from vllm.distributed.parallel_state import get_tp_group
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        vllm_config = self._vllm_config
        if vllm_config is None:
            raise RuntimeError("initialize_storage() needs a connector from bind()")
        if not get_tp_group().is_first_rank:
            return
        self.close()  # the same namespace: the old store goes first
        spec = self._capture.spec
        cfg = vllm_config.artifact_config
        sched = vllm_config.scheduler_config
        _, block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        namespace = cfg.namespace(vllm_config.parallel_config.data_parallel_rank)
        # Set from the node by verify_artifact_config when left unset.
        capacity = cfg.capacity_bytes or DEFAULT_CAPACITY_BYTES
        writer: ObjectStoreWriter = ShmStoreWriter(
            cfg.shm_root,
            namespace,
            capacity_bytes=capacity,
            inactive_ttl_s=cfg.inactive_ttl_s,
        )
        if cfg.backend == "mooncake":
            from vllm.distributed.artifact_connector.mooncake import (
                SharedTierWriter,
            )

            writer = SharedTierWriter.open(writer, vllm_config)
        try:
            slab = RowSlab.for_scheduler(
                spec,
                block_size,
                max_num_seqs=sched.max_num_seqs,
                max_num_batched_tokens=sched.max_num_batched_tokens,
                steps_in_flight=vllm_config.max_concurrent_batches
                + MAX_QUEUED_STEPS
                + 1,
                gathered_pages=GATHER_OBJECTS,
            )
            publisher = ArtifactPublisher(
                writer,
                spec,
                slab,
                KeySpace(
                    cfg.key_namespace(vllm_config.parallel_config.data_parallel_rank)
                ),
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
            capacity / (1 << 30),
            slab.nbytes / (1 << 20),
        )
        self._publisher = publisher

    def begin_step(self, meta: ArtifactSchedulerMeta | None) -> None:
        """Take the scheduler's messages for this step (main thread); they
        are handed to publication with the step's rows (one flush a step)."""
        publisher = self._publisher
        if publisher is None or meta is None:
            return
        if meta.releases or meta.discards:
            self._settle = True
        publisher.apply(meta)

    def prepare_step(self, input_batch: InputBatch) -> PendingArtifactStep | None:
        """Snapshot this step's rows (main thread, after the forward)."""
        publisher = self._publisher
        if publisher is None:
            return None
        n = len(input_batch.req_ids)
        qsl = input_batch.query_start_loc_np[: n + 1].copy()
        return PendingArtifactStep(
            self,
            publisher.current_attempts(input_batch.req_ids[:n]),
            publisher.weight_version,
            input_batch.num_computed_tokens_np[:n].copy(),
            qsl,
            self._capture.snapshot(int(qsl[-1])),
        )

    def process(self, step: PendingArtifactStep) -> ArtifactWorkerReport | None:
        """The step's rows into the publisher, then the step's one flush
        (output thread)."""
        publisher = self._publisher
        if publisher is None or step.rows is None or step.num_rejected is None:
            raise RuntimeError("process() needs a copied step of the publishing rank")
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
        publisher.write_step(
            step.attempts,
            step.starts,
            counts,
            rows,
            scheduled=scheduled,
            weight_version=step.weight_version,
        )
        publisher.flush(gather=True)
        return self._take_report()

    def no_forward(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """An empty step still hands over its messages and carries
        acknowledgements, so a finished request's output is never stranded
        when nothing else runs."""
        publisher = self._publisher
        if publisher is None:
            return output
        publisher.flush()
        if publisher.owes_answers():
            publisher.wait_for_answers(EMPTY_STEP_WAIT_S)
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
        assert publisher is not None  # the callers checked
        report = publisher.report()
        now = time.monotonic()
        if stats_now or now >= self._stats_due:
            stats = publisher.metrics()
            self._stats_due = now + STATS_INTERVAL_S
            if stats != self._stats_sent:
                self._stats_sent = stats
                report = dataclasses.replace(report, stats=stats)
        return None if report.is_empty() else report

    def stats(self) -> dict[str, int]:
        """Store counters, attempts alive and row-slab pages in use; empty
        on ranks that do not publish."""
        return {} if self._publisher is None else self._publisher.stats()

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
