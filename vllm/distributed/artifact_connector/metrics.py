# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prometheus metrics of routed experts (R3).

Three stages, like the KV connector's statistics:

* the publishing worker puts a snapshot of its store's counters on its
  :class:`~.protocol.ArtifactWorkerReport` (:meth:`ArtifactPublisher.metrics
  <.publisher.ArtifactPublisher.metrics>`, at most once per
  :data:`STATS_INTERVAL_S`, and on the empty step that ends a burst of work);
* the scheduler's :class:`ArtifactStatsCollector` adds its own counts (requests
  with and without routes, failures by error type, read and publication
  times) and turns the worker's cumulative counters into increments; the
  scheduler hands :meth:`ArtifactStatsCollector.take` to the frontend as
  ``SchedulerStats.artifact_stats`` (a plain dict, like
  ``kv_connector_stats``);
* :class:`ArtifactProm`, built by vLLM's ``PrometheusStatLogger``, records
  them under the usual ``model_name`` and ``engine`` labels.

Counts are exact: every increment the scheduler makes travels once, in the
``SchedulerStats`` of the step that made it. With R3 off nothing is
registered. This module imports only the standard library and
``prometheus_client`` (the frontend loads it).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# The publishing worker sends its store counters at most this often (and
# once more on the empty step after the last request, see the connector).
STATS_INTERVAL_S = 1.0

# The worker's snapshot (``ArtifactPublisher.metrics``): values shown as is,
# and cumulative counters the scheduler turns into increments.
STORE_GAUGES = (
    "objects",
    "used_bytes",
    "capacity_bytes",
    "retained_keys",
    "queue_depth",
)
STORE_COUNTERS = (
    "puts_written",
    "divergences",
    "evicted_objects",
    "space_evictions",
    "space_compactions",
    "shared_puts",
    "shared_pulls",
    "shared_failures",
    "shared_rejected",
    "shared_settles",
    "shared_settles_late",
)
# Routes handed out by reference (``RouteRefs.counters``, engine core).
REF_GAUGES = ("waiting_bytes",)
REF_COUNTERS = ("published", "expired")

# Failure causes shown at zero from the start (others appear when they occur).
KNOWN_ERRORS = (
    "ObjectMissingError",
    "ChecksumMismatchError",
    "WeightVersionMismatchError",
    "StoreCapacityError",
    "ArtifactAckTimeout",
    "ArtifactReadTimeout",
    "RouteRefPublishError",
    "CoverageError",
)

# Reading a request's rows: one verified object per block of tokens.
MATERIALIZATION_BUCKETS = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
# A finish's acknowledgement: one step or two, up to the 60 s timeout.
PUBLISH_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
)  # fmt: skip


def error_type(error: str) -> str:
    """The type name of an ``"<ErrorType>: <message>"`` string."""
    return error.split(":", 1)[0].strip() or "ArtifactError"


class ArtifactStatsCollector:
    """Scheduler side: counts since the last :meth:`take` (see the module
    docs). Not thread-safe; the engine thread owns it."""

    def __init__(self) -> None:
        self.requests_routed = 0
        self.failures: collections.Counter[str] = collections.Counter()
        self.materialization_s: list[float] = []
        self.publish_s: list[float] = []
        self._store: dict[str, int] | None = None  # a snapshot not taken yet
        self._store_totals: dict[str, int] = {}  # the worker's last totals
        self._store_increments: collections.Counter[str] = collections.Counter()
        self._refs: dict[str, int] | None = None
        self._refs_totals: dict[str, int] = {}
        self._refs_increments: collections.Counter[str] = collections.Counter()

    def request_done(self, error: str | None) -> None:
        """A request's final output went out with routes (``error`` None)
        or without them because of ``error``."""
        if error is None:
            self.requests_routed += 1
        else:
            self.failures[error_type(error)] += 1

    def worker_snapshot(self, snapshot: dict[str, int]) -> None:
        """The publishing worker's latest store counters."""
        self._store = {k: snapshot[k] for k in STORE_GAUGES if k in snapshot}
        for k in STORE_COUNTERS:
            # Totals only grow; one taken earlier may arrive later (the
            # worker reports from two threads): never count anything twice.
            last = self._store_totals.get(k, 0)
            total = snapshot.get(k, last)
            if total > last:
                self._store_increments[k] += total - last
                self._store_totals[k] = total

    def refs_snapshot(self, snapshot: dict[str, int]) -> None:
        """The route reader's reference counters, when they changed."""
        if snapshot == self._refs_totals:
            return
        self._refs = {k: snapshot[k] for k in REF_GAUGES}
        for k in REF_COUNTERS:
            self._refs_increments[k] += snapshot[k] - self._refs_totals.get(k, 0)
        self._refs_totals = dict(snapshot)

    def take(self) -> dict[str, Any] | None:
        """What changed since the last call (None if nothing), as a plain
        dict for ``SchedulerStats.artifact_stats``."""
        if not (
            self.requests_routed
            or self.failures
            or self.materialization_s
            or self.publish_s
            or self._store is not None
            or self._refs is not None
        ):
            return None
        out: dict[str, Any] = {
            "requests_routed": self.requests_routed,
            "failures": dict(self.failures),
            "materialization_s": self.materialization_s,
            "publish_s": self.publish_s,
        }
        if self._store is not None:
            out["store"] = self._store
            out["store_increments"] = dict(self._store_increments)
        if self._refs is not None:
            out["refs"] = self._refs
            out["refs_increments"] = dict(self._refs_increments)
            self._refs = None
            self._refs_increments = collections.Counter()
        self.requests_routed = 0
        self.failures = collections.Counter()
        self.materialization_s = []
        self.publish_s = []
        self._store = None
        self._store_increments = collections.Counter()
        return out


class ArtifactProm:
    """The R3 metrics on vLLM's Prometheus ``/metrics``; built by
    ``PrometheusStatLogger`` (``stat_logger``), whose metric classes
    (``_gauge_cls``, ``_counter_cls``, ``_histogram_cls``: class attributes a
    subclass may replace) and labels it uses. Registers nothing when routed
    experts are off."""

    def __init__(
        self,
        stat_logger: Any,
        vllm_config: VllmConfig,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        gauge_cls = stat_logger._gauge_cls
        counter_cls = stat_logger._counter_cls
        histogram_cls = stat_logger._histogram_cls
        self.enabled = vllm_config.artifact_config.enable_routed_experts
        if not self.enabled:
            return
        self._labelvalues = per_engine_labelvalues

        def per_engine(metric: Any) -> dict[int, Any]:
            return {
                idx: metric.labels(*values)
                for idx, values in per_engine_labelvalues.items()
            }

        def gauge(name: str, doc: str) -> dict[int, Any]:
            return per_engine(
                gauge_cls(
                    name=name,
                    documentation=doc,
                    multiprocess_mode="mostrecent",
                    labelnames=labelnames,
                )
            )

        def counter(name: str, doc: str) -> dict[int, Any]:
            return per_engine(
                counter_cls(name=name, documentation=doc, labelnames=labelnames)
            )

        def histogram(name: str, doc: str, buckets: tuple) -> dict[int, Any]:
            return per_engine(
                histogram_cls(
                    name=name,
                    documentation=doc,
                    buckets=list(buckets),
                    labelnames=labelnames,
                )
            )

        p = "vllm:routed_experts_"
        self.requests_routed = counter(
            p + "requests_routed",
            "Requests whose final output carried routed experts (each choice "
            "of n > 1 counts; aborted requests that had returned tokens too).",
        )
        self.failures = counter_cls(
            name=p + "request_failures",
            documentation="Requests that ended without routed experts because "
            "of an error, by error type.",
            labelnames=[*labelnames, "error_type"],
        )
        for values in per_engine_labelvalues.values():
            for name in KNOWN_ERRORS:
                self.failures.labels(*values, name)
        self.materialization = histogram(
            p + "materialization_seconds",
            "Time the engine core's route reader took to read and verify a "
            "finished request's routes from the store (failed reads included), "
            "plus, by reference, the hand-off into the reference transport.",
            MATERIALIZATION_BUCKETS,
        )
        self.publish = histogram(
            p + "publish_seconds",
            "Time from a request's end in the scheduler to the publishing "
            "worker's acknowledgement (or failure, or timeout) of its routes.",
            PUBLISH_BUCKETS,
        )
        self.store_gauges = {
            "objects": gauge(
                p + "store_objects", "Objects (versions) in the routes store."
            ),
            "used_bytes": gauge(
                p + "store_used_bytes",
                "Bytes the routes store occupies in /dev/shm (arenas, the "
                "spare one included, and the index log).",
            ),
            "capacity_bytes": gauge(
                p + "store_capacity_bytes", "The routes store's capacity_bytes."
            ),
            "retained_keys": gauge(
                p + "store_retained_objects",
                "Keys of the routes store that running or finishing requests "
                "hold (never evicted).",
            ),
            "queue_depth": gauge(
                p + "publish_queue_depth",
                "Most steps waiting for the publication thread since the last "
                "update (at its limit, 4, the engine waits).",
            ),
        }
        self.store_counters = {
            "puts_written": counter(
                p + "store_published_objects",
                "Objects written to the routes store.",
            ),
            "divergences": counter(
                p + "store_divergences",
                "Puts of different bytes under an existing key (stored as a "
                "new version).",
            ),
            "evicted_objects": counter(
                p + "store_evicted_objects",
                "Objects evicted from the routes store to make room.",
            ),
            "space_evictions": counter(
                p + "store_space_evictions",
                "Arenas the routes store evicted because /dev/shm itself was "
                "full or nearly so (other engines, other files), to keep "
                "serving puts.",
            ),
            "space_compactions": counter(
                p + "store_space_compactions",
                "Index-log compactions the routes store made for the same reason.",
            ),
            "shared_puts": counter(
                p + "store_shared_published_objects",
                "Objects mirrored into the Mooncake Store of the key space "
                "(backend mooncake).",
            ),
            "shared_pulls": counter(
                p + "store_shared_pulled_objects",
                "Objects other engines of the key space computed, taken from "
                "the Mooncake Store for prefix hits on their KV.",
            ),
            "shared_failures": counter(
                p + "store_shared_failures",
                "Objects whose write into the Mooncake Store failed, or was "
                "skipped while the store was slow or down or the key space's "
                "recorded terms disagreed (other engines recompute those "
                "blocks instead of loading their KV).",
            ),
            "shared_rejected": counter(
                p + "store_shared_rejected_objects",
                "Objects read from the Mooncake Store that failed their "
                "authentication (the key space's shared secret) or checks, "
                "treated as missing (the blocks are recomputed).",
            ),
            "shared_settles": counter(
                p + "store_shared_settles",
                "Acknowledgements of finished requests held until the mirror "
                "of their objects into the Mooncake Store ended (engines whose "
                "answers send other engines to those objects), at most 0.25 s "
                "each; other requests never wait for them.",
            ),
            "shared_settles_late": counter(
                p + "store_shared_settles_late",
                "Of those, the ones that left after 0.25 s with the mirror "
                "still in flight (a slow or frozen master: the engine they "
                "send to the objects may recompute instead).",
            ),
        }
        self.ref_gauges = {
            "waiting_bytes": gauge(
                p + "refs_waiting_bytes",
                "Bytes of routes handed out by reference (routed_experts_format "
                "ref) not yet removed: unfetched ones, and fetched ones until "
                "their TTL ends (bounded by ref_max_bytes).",
            ),
        }
        self.ref_counters = {
            "published": counter(
                p + "refs_published",
                "Routes put into the reference transport (ref_transport) by "
                "reference; a put that lands after its request's deadline is "
                "counted, then removed.",
            ),
            "expired": counter(
                p + "refs_expired",
                "Routes handed out by reference and removed unfetched (after "
                "ref_ttl_s, or to stay within ref_max_bytes).",
            ),
        }

    def observe(self, data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one ``SchedulerStats.artifact_stats``."""
        if not self.enabled:
            return
        if data["requests_routed"]:
            self.requests_routed[engine_idx].inc(data["requests_routed"])
        values = self._labelvalues[engine_idx]
        for name, n in data["failures"].items():
            self.failures.labels(*values, name).inc(n)
        hist = self.materialization[engine_idx]
        for seconds in data["materialization_s"]:
            hist.observe(seconds)
        hist = self.publish[engine_idx]
        for seconds in data["publish_s"]:
            hist.observe(seconds)
        for name, value in data.get("store", {}).items():
            if name in self.store_gauges:
                self.store_gauges[name][engine_idx].set(value)
        for name, n in data.get("store_increments", {}).items():
            if n and name in self.store_counters:
                self.store_counters[name][engine_idx].inc(n)
        for name, value in data.get("refs", {}).items():
            self.ref_gauges[name][engine_idx].set(value)
        for name, n in data.get("refs_increments", {}).items():
            if n:
                self.ref_counters[name][engine_idx].inc(n)
