# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hand-offs by reference on their own thread (``RouteHandoff``), with a real
``RouteRefs`` on the real host transport whose put is held by the test (a
held thread, standing in for a frozen Mooncake master): reads never wait
behind it, the stuck transport trips the breaker, a put that returns late is
retired, a sink fault fails one reference only, expiry runs on its
schedule while hand-offs keep coming, and a weight version's references are
retired on the thread."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

from vllm.config.artifact import ArtifactConfig
from vllm.distributed.artifact_connector import breaker, route_handoff
from vllm.distributed.artifact_connector.route_handoff import Handoff, RouteHandoff
from vllm.distributed.artifact_connector.route_refs import RouteRefs
from vllm.distributed.artifact_connector.route_results import RouteResults
from vllm_host_transport import routed_experts
from vllm_host_transport.routed_experts import RouteRefMissingError, fetch
from vllm_host_transport.routes_format import encode

ROWS = np.random.default_rng(3).integers(0, 128, (40, 4, 2), dtype=np.uint8)
STORED = encode(ROWS).nbytes  # a payload's bytes, header included


class _HeldRefs(RouteRefs):
    """A real RouteRefs whose sink's put waits while ``hold`` is clear."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.hold = threading.Event()
        self.hold.set()
        self.in_put = threading.Event()
        self.fail_next: Exception | None = None
        self.expiries = 0
        put = self._sink.put

        def held_put(*args):
            self.in_put.set()
            assert self.hold.wait(60)
            if self.fail_next is not None:
                e, self.fail_next = self.fail_next, None
                raise e
            return put(*args)

        self._sink.put = held_put  # type: ignore[method-assign]

    def expire(self):
        self.expiries += 1
        super().expire()


@pytest.fixture
def handoff():
    cfg = ArtifactConfig(ref_scope=f"handoff-{uuid.uuid4().hex[:10]}", ref_ttl_s=60)
    made: list[_HeldRefs] = []

    def make():
        made.append(_HeldRefs(cfg))
        return made[0]

    results = RouteResults()
    h = RouteHandoff(results, make, timeout_s=0.5)
    yield h, results, made
    for r in made:
        r.hold.set()
    h.close()
    routed_experts.close()


def _job(name: str, timeout_s: float = 0.5, version: str = "") -> Handoff:
    return Handoff(name, 1, ROWS, 0, time.monotonic() + timeout_s, version)


def _wait(results, n, timeout=30.0):
    done = []
    deadline = time.monotonic() + timeout
    while len(done) < n and time.monotonic() < deadline:
        results.wait_all(0.05)
        done += results.take()
    return done


def test_a_handed_out_reference_fetches_exactly(handoff):
    h, results, _ = handoff
    h.submit([_job("a")])
    (res,) = _wait(results, 1)
    assert res.handed_off and res.error is None and res.ref is not None
    for _ in range(2):  # read-many
        np.testing.assert_array_equal(fetch(res.ref), ROWS)


def test_a_stuck_transport_fails_references_at_once_and_recovers(handoff):
    h, results, made = handoff
    h.submit([_job("warm")])
    assert _wait(results, 1)[0].error is None
    refs = made[0]
    refs.in_put.clear()
    refs.hold.clear()
    h.submit([_job("stuck")])
    assert refs.in_put.wait(30)
    # Past the deadline with the put still in the transport: the breaker is
    # open, a new hand-off is answered at once, on the engine thread.
    time.sleep(0.6)
    t0 = time.monotonic()
    h.submit([_job("later")])
    (later,) = results.take()
    assert time.monotonic() - t0 < 0.5
    assert later.req_id == "later" and later.ref is None
    assert later.error.startswith("RouteRefPublishError: a call has been in")
    # The stuck put returns: its reference is handed out too late and
    # retired (nobody will get it), and the breaker pauses the transport.
    refs.hold.set()
    (stuck,) = _wait(results, 1)
    assert stuck.req_id == "stuck" and stuck.ref is None
    assert stuck.error == "RouteRefPublishError: handed out past its deadline"
    assert refs.counters()["waiting_bytes"] == STORED  # "warm" alone
    h.submit([_job("paused")])
    (paused,) = results.take()
    assert "calls are paused for 1 s" in paused.error
    # After the pause, references flow again.
    time.sleep(breaker.BASE_S + 0.1)
    h.submit([_job("again", 5.0)])
    (again,) = _wait(results, 1)
    assert again.error is None, again.error
    np.testing.assert_array_equal(fetch(again.ref), ROWS)


def test_a_sink_fault_fails_that_reference_only(handoff):
    h, results, made = handoff
    h.submit([_job("warm", 5.0)])
    assert _wait(results, 1)[0].error is None
    made[0].fail_next = OSError("stand-in for a transport bug")
    h.submit([_job("bad", 5.0), _job("good", 5.0)])
    by_id = {r.req_id: r for r in _wait(results, 2)}
    assert by_id["bad"].ref is None
    assert by_id["bad"].error.startswith(
        "RouteRefPublishError: the reference transport failed: OSError"
    )
    assert by_id["good"].error is None
    np.testing.assert_array_equal(fetch(by_id["good"].ref), ROWS)


def test_expiry_runs_on_its_schedule_under_steady_hand_offs(monkeypatch):
    monkeypatch.setattr(route_handoff, "EXPIRY_INTERVAL_S", 0.2)
    cfg = ArtifactConfig(ref_scope=f"handoff-{uuid.uuid4().hex[:10]}", ref_ttl_s=0.3)
    made: list[_HeldRefs] = []
    results = RouteResults()
    h = RouteHandoff(results, lambda: made.append(_HeldRefs(cfg)) or made[0], 5.0)
    try:
        end = time.monotonic() + 1.5
        n = 0
        while time.monotonic() < end:  # never idle for long
            h.submit([_job(f"r{n}", 5.0)])
            n += 1
            assert _wait(results, 1)[0].error is None
            time.sleep(0.02)
        assert made[0].expiries >= 3
        time.sleep(0.5)  # the last ones expire too, with no hand-off coming
        assert made[0].counters()["expired"] == n
        assert made[0].counters()["waiting_bytes"] == 0
    finally:
        h.close()


def test_a_weight_versions_references_are_retired_on_the_thread(handoff):
    """``retire_versions`` (the scheduler, when the weight version moves
    past ``ref_versions_kept``) returns at once; the hand-off thread
    removes the references of the versions not kept and hands out new ones
    as before."""
    h, results, made = handoff
    h.submit([_job("v1", 5.0, "v1"), _job("v1-v2", 5.0, "v1,v2")])
    h.submit([_job("v2", 5.0, "v2")])
    by_id = {r.req_id: r for r in _wait(results, 3)}
    assert all(r.error is None for r in by_id.values())
    assert by_id["v1-v2"].ref.weight_version == "v1,v2"
    t0 = time.monotonic()
    h.retire_versions(("v2", "v3"))
    assert time.monotonic() - t0 < 0.1
    deadline = time.monotonic() + 10
    while made[0].version_retired < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert made[0].version_retired == 1
    with pytest.raises(RouteRefMissingError):
        fetch(by_id["v1"].ref)
    for kept in ("v1-v2", "v2"):
        np.testing.assert_array_equal(fetch(by_id[kept].ref), ROWS)
    assert made[0].counters()["waiting_bytes"] == 2 * STORED
    h.submit([_job("v3", 5.0, "v3")])
    (v3,) = _wait(results, 1)
    assert v3.error is None and v3.ref.weight_version == "v3"
    np.testing.assert_array_equal(fetch(v3.ref), ROWS)


def test_a_frozen_master_at_start_freezes_no_step_loop():
    """``ref_transport: mooncake`` with a real master frozen before the
    engine starts (r5 M1): the hand-off thread's join fails while the master
    is still frozen (probed in a child process; Mooncake's ``setup`` would
    hold the interpreter lock until it resumes, 30 s later), the step loop
    (this thread) keeps running, and references fail saying why."""
    pytest.importorskip("mooncake.store", reason="installed by `make setup`")
    from utils.mooncake import Ticker, running_master

    with running_master("mooncake-master-handoff-frozen") as master:
        cfg = ArtifactConfig(
            ref_transport="mooncake",
            mooncake_master=master.address,
            mooncake_segment_bytes=16 << 20,
            mooncake_buffer_bytes=16 << 20,
        )
        ticker = Ticker()
        results = RouteResults()
        master.freeze(resume_after_s=30.0)
        start = time.monotonic()
        h = RouteHandoff(results, lambda: RouteRefs(cfg), 5.0, open_now=True)
        try:
            while h._refs_error is None and master.still_frozen():
                time.sleep(0.01)
            end = time.monotonic()
            assert master.still_frozen() and h._refs_error is not None
            assert "did not answer" in h._refs_error
            third = (end - start) / 3
            assert ticker.ticked_between(start + third, end - third)
            h.submit([_job("r", 5.0)])
            (res,) = _wait(results, 1)
            assert res.ref is None and "did not answer" in res.error
        finally:
            master.thaw()
            h.close()
            ticker.stop()


def test_an_unexpected_fault_opening_the_transport_fails_its_jobs():
    """A transport whose opening raises something unexpected (a Mooncake
    binding's ``RuntimeError``; r5 L3): every queued reference fails with
    ``RouteRefPublishError`` naming it, nothing stays queued or pending, and
    the transport is opened once, not once per reference."""
    opened = []

    def make_refs():
        opened.append(1)
        raise RuntimeError("Mooncake client binding: unexpected failure")

    results = RouteResults()
    h = RouteHandoff(results, make_refs, 5.0, open_now=True)
    try:
        for i in range(3):
            h.submit([_job(f"r{i}", 5.0)])
        got = _wait(results, 3, timeout=10.0)
        assert len(got) == 3, got
        for res in got:
            assert res.ref is None
            assert "RouteRefPublishError" in res.error
            assert "unexpected failure" in res.error
        assert results.pending == 0 and not h._queued
        assert len(opened) == 1
    finally:
        h.close()
