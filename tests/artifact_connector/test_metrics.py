# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""R3's Prometheus metrics without an engine: the scheduler's collector
(increments taken once, the worker's cumulative totals turned into
increments, out of order included), ArtifactProm on a private registry
(nothing registered with R3 off), and the worker connector's store snapshot
on a real /dev/shm store (sent first, then only when due or on an empty step
after releases, showing the store at rest once the last request let go)."""

import functools
import hashlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm.distributed.artifact_connector.buffer import RowSlab
from vllm.distributed.artifact_connector.metrics import (
    KNOWN_ERRORS,
    ArtifactProm,
    ArtifactStatsCollector,
)
from vllm.distributed.artifact_connector.protocol import (
    ArtifactSchedulerMeta,
    ArtifactWorkerReport,
    AttemptStart,
    BlockHashes,
    Finalize,
    Release,
)
from vllm.distributed.artifact_connector.publisher import ArtifactPublisher
from vllm.distributed.artifact_connector.request_core import KeySpace
from vllm.distributed.artifact_connector.shm import ShmStoreWriter, make_namespace
from vllm.distributed.artifact_connector.worker import (
    ArtifactWorkerConnector,
    PendingArtifactStep,
)
from vllm.utils.routed_experts_rows import RowSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

SPEC = RowSpec(3, 2)
B = 4
LABELS = ["model_name", "engine"]


# ------------------------------------------------------------ the collector
def test_collector_hands_each_increment_out_once():
    c = ArtifactStatsCollector()
    assert c.take() is None
    c.request_done(None)
    c.request_done(None)
    c.request_done("ChecksumMismatchError: bytes changed: a: b")
    c.request_done("ObjectMissingError: gone")
    c.request_done("ChecksumMismatchError: again")
    c.materialization_s.append(0.002)
    c.publish_s.append(0.01)
    got = c.take()
    assert got == {
        "requests_routed": 2,
        "failures": {"ChecksumMismatchError": 2, "ObjectMissingError": 1},
        "materialization_s": [0.002],
        "publish_s": [0.01],
    }
    assert c.take() is None
    c.request_done(None)
    assert c.take()["requests_routed"] == 1


def test_collector_turns_worker_totals_into_increments():
    c = ArtifactStatsCollector()
    snap = {
        "objects": 5,
        "used_bytes": 100,
        "capacity_bytes": 1000,
        "retained_keys": 2,
        "queue_depth": 1,
        "puts_written": 5,
        "divergences": 0,
        "evicted_objects": 0,
    }
    c.worker_snapshot(snap)
    first = c.take()
    assert first["store"]["objects"] == 5 and first["store"]["retained_keys"] == 2
    assert first["store_increments"] == {"puts_written": 5}
    assert first["requests_routed"] == 0
    later = {**snap, "puts_written": 9, "evicted_objects": 3, "retained_keys": 0}
    earlier = {**snap, "puts_written": 7, "evicted_objects": 1}
    c.worker_snapshot(later)
    c.worker_snapshot(earlier)  # taken before `later`, arrived after it
    c.worker_snapshot(later)  # sent twice
    got = c.take()
    assert got["store_increments"] == {"puts_written": 4, "evicted_objects": 3}
    assert c.take() is None


# ------------------------------------------------------------ Prometheus
def _prom(enabled: bool, engines=(0,)):
    reg = CollectorRegistry()
    cfg = SimpleNamespace(
        artifact_config=SimpleNamespace(enable_routed_experts=enabled)
    )
    # PrometheusStatLogger's metric classes, on a registry of the test's.
    stat_logger = SimpleNamespace(
        _gauge_cls=functools.partial(Gauge, registry=reg),
        _counter_cls=functools.partial(Counter, registry=reg),
        _histogram_cls=functools.partial(Histogram, registry=reg),
    )
    prom = ArtifactProm(
        stat_logger, cfg, LABELS, {i: ["tiny", str(i)] for i in engines}
    )
    return prom, reg


def test_prometheus_records_per_engine():
    prom, reg = _prom(True, engines=(0, 1))

    def value(name, engine="0", **labels):
        return reg.get_sample_value(
            name, {"model_name": "tiny", "engine": engine, **labels}
        )

    # Known causes are there from the start, at zero.
    failures = "vllm:routed_experts_request_failures_total"
    for cause in KNOWN_ERRORS:
        assert value(failures, error_type=cause) == 0
    c = ArtifactStatsCollector()
    c.request_done(None)
    c.request_done(None)
    c.request_done("ArtifactAckTimeout: no acknowledgement")
    c.request_done("RowBufferCapacityError: full")
    c.materialization_s += [0.0003, 0.2]
    c.publish_s.append(0.004)
    c.worker_snapshot(
        {
            "objects": 7,
            "used_bytes": 4096,
            "capacity_bytes": 1 << 20,
            "retained_keys": 3,
            "queue_depth": 2,
            "puts_written": 7,
            "divergences": 1,
            "evicted_objects": 0,
            "space_evictions": 2,
            "space_compactions": 1,
        }
    )
    prom.observe(c.take(), engine_idx=1)
    c.request_done(None)
    prom.observe(c.take(), engine_idx=1)

    assert value("vllm:routed_experts_requests_routed_total", "1") == 3
    assert value("vllm:routed_experts_requests_routed_total", "0") == 0
    assert value(failures, "1", error_type="ArtifactAckTimeout") == 1
    assert value(failures, "1", error_type="RowBufferCapacityError") == 1
    assert value(failures, "1", error_type="ChecksumMismatchError") == 0
    hist = "vllm:routed_experts_materialization_seconds"
    assert value(hist + "_count", "1") == 2
    assert value(hist + "_bucket", "1", le="0.0005") == 1
    assert value("vllm:routed_experts_publish_seconds_count", "1") == 1
    assert value("vllm:routed_experts_store_objects", "1") == 7
    assert value("vllm:routed_experts_store_used_bytes", "1") == 4096
    assert value("vllm:routed_experts_store_capacity_bytes", "1") == 1 << 20
    assert value("vllm:routed_experts_store_retained_objects", "1") == 3
    assert value("vllm:routed_experts_publish_queue_depth", "1") == 2
    assert value("vllm:routed_experts_store_published_objects_total", "1") == 7
    assert value("vllm:routed_experts_store_divergences_total", "1") == 1
    assert value("vllm:routed_experts_store_evicted_objects_total", "1") == 0
    assert value("vllm:routed_experts_store_space_evictions_total", "1") == 2
    assert value("vllm:routed_experts_store_space_compactions_total", "1") == 1


def test_prometheus_registers_nothing_with_r3_off():
    prom, reg = _prom(False)
    assert not [m for m in reg.collect() if m.name.startswith("vllm:")]
    c = ArtifactStatsCollector()
    c.request_done(None)
    prom.observe(c.take())  # ignored
    assert not [m for m in reg.collect() if m.name.startswith("vllm:")]


# ------------------------------------------------------------ the worker
def bh(req: str, block: int) -> bytes:
    return hashlib.sha256(f"{req}:{block}".encode()).digest()


@pytest.fixture
def conn(shm_root):
    ns = make_namespace("metrics-test")
    writer = ShmStoreWriter(shm_root, ns, capacity_bytes=1 << 20)
    publisher = ArtifactPublisher(writer, SPEC, RowSlab(SPEC, B, 64), KeySpace(ns))
    conn = ArtifactWorkerConnector(capture=None, publisher=publisher)
    yield conn
    conn.close()


def _step(conn, req, start, n):
    rows = np.full((n, 3, 2), start % 251, np.uint8)
    pending = PendingArtifactStep(
        conn,
        conn._publisher.current_attempts([req]),  # as prepare_step takes it
        "default",
        np.array([start], np.int32),
        np.array([0, n], np.int32),
        torch.from_numpy(rows),
    )
    pending.enqueue_cpu_copy(np.zeros(1, np.int32))
    return pending.process()


def test_worker_reports_the_store_first_when_due_and_at_rest(conn):
    # The first report carries the counters (nothing published yet).
    out = conn.no_forward(EMPTY_MODEL_RUNNER_OUTPUT)
    assert out.artifact_report.stats["objects"] == 0
    assert out.artifact_report.stats["capacity_bytes"] == 1 << 20
    # From now on the periodic snapshot is never due (no clock in the test).
    conn._stats_due = float("inf")
    # Nothing else to say: the shared empty output is returned untouched.
    assert conn.no_forward(EMPTY_MODEL_RUNNER_OUTPUT) is EMPTY_MODEL_RUNNER_OUTPUT
    assert EMPTY_MODEL_RUNNER_OUTPUT.artifact_report is None

    r = "req"
    hashes = (BlockHashes(r, 1, 0, (bh(r, 0), bh(r, 1))),)
    conn.begin_step(
        ArtifactSchedulerMeta(starts=(AttemptStart(r, 1, 0),), hashes=hashes)
    )
    report = _step(conn, r, 0, 8)
    assert report is None or report.stats is None
    conn.begin_step(ArtifactSchedulerMeta(finalizes=(Finalize(r, 1, 8),)))
    acks: list = []
    snapshots = []
    for _ in range(200):
        report = conn.no_forward(EMPTY_MODEL_RUNNER_OUTPUT).artifact_report
        if report is not None:
            acks += report.acks
            assert not report.failures
            if report.stats is not None:
                snapshots.append(report.stats)
        if acks:
            break
    assert acks and acks[0].req_id == r
    assert not snapshots  # an acknowledgement alone does not force them
    # The scheduler read the rows and releases them; the empty step that
    # carries the release reports the store at rest.
    conn.begin_step(ArtifactSchedulerMeta(releases=(Release(r, 1),)))
    report = conn.no_forward(EMPTY_MODEL_RUNNER_OUTPUT).artifact_report
    assert report is not None and report.stats is not None
    s = report.stats
    assert s["objects"] == 2 and s["puts_written"] == 2
    assert s["retained_keys"] == 0 and s["used_bytes"] > 0
    assert conn.stats()["retainers"] == 0
    # The queue depth is the peak since the last snapshot: nothing was
    # handed over since.
    assert conn._publisher.metrics()["queue_depth"] == 0


def test_reports_with_counters_only_are_not_empty():
    assert not ArtifactWorkerReport(stats={"objects": 0}).is_empty()
    assert ArtifactWorkerReport().is_empty()
