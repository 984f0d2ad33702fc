# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Both sides of the Artifact Connector wired together without a model, to
force interleavings the engine produces only by chance: the real scheduler
connector (built from a real ``VllmConfig`` of the tiny MoE) and the real
publisher on a real ``/dev/shm`` store, driven by real ``Request`` objects
with the prefix cache's block hasher. The scheduler's ``finish_requests`` is
reduced to what it does for the connector (status, then ``on_finish``)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from utils.r3 import shm_root

B = 32  # hash block size (the config's block size)


class TwoSides:
    def __init__(self, model) -> None:
        from vllm.config.artifact import routed_experts_row_spec
        from vllm.distributed.artifact_connector.buffer import RowSlab
        from vllm.distributed.artifact_connector.publisher import ArtifactPublisher
        from vllm.distributed.artifact_connector.request_core import KeySpace
        from vllm.distributed.artifact_connector.scheduler import (
            ArtifactSchedulerConnector,
        )
        from vllm.distributed.artifact_connector.shm import ShmStoreWriter
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import (
            get_request_block_hasher,
            init_none_hash,
        )

        self.root = shm_root()
        cfg = EngineArgs(
            model=str(model),
            block_size=B,
            dtype="float32",
            max_model_len=1024,
            enable_routed_experts=True,
            artifact_config={"shm_root": self.root, "capacity_bytes": 4 << 20},
        ).create_engine_config()
        art = cfg.artifact_config
        ns = art.namespace(0)
        self.spec = routed_experts_row_spec(cfg)
        self.keys = KeySpace(ns)
        self.writer = ShmStoreWriter(
            art.shm_root, ns, capacity_bytes=art.capacity_bytes
        )
        self.pub = ArtifactPublisher(
            self.writer, self.spec, RowSlab(self.spec, B, 64), self.keys
        )
        self.sched = ArtifactSchedulerConnector(cfg, hash_block_size=B)
        self.handles: dict = {}
        hash_fn = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(B, hash_fn)
        self.requests: dict = {}

    def request(self, req_id: str, num_prompt: int, max_tokens: int = 50):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request, RequestStatus

        prompt = np.random.default_rng(len(req_id)).integers(10, 400, num_prompt)
        request = Request(
            req_id,
            prompt.tolist(),
            SamplingParams(max_tokens=max_tokens),
            None,
            block_hasher=self.hasher,
        )
        request.status = RequestStatus.RUNNING
        self.requests[req_id] = request
        return request

    def rows(self, start: int, n: int) -> np.ndarray:
        layers, top_k = self.spec.row_shape
        pos = np.arange(start, start + n)[:, None, None]
        ids = (pos * 3 + np.arange(layers * top_k).reshape(layers, top_k)) % 8
        return ids.astype(self.spec.dtype)

    def step(self, new=(), rows=()):
        """One engine step: schedule (the meta), the worker's messages and
        rows ``(request, attempt, start, n)``, its one flush, then the
        scheduler's update; returns the outputs per client."""
        from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

        so = SchedulerOutput.make_empty()
        so.scheduled_new_reqs = [NewRequestData.from_request(r, ([],)) for r in new]
        meta = self.sched.build_meta(so, self.requests)
        self.pub.apply(meta)
        # As the worker does when it prepares a step: the handle of each
        # request's attempt now (late rows of an older one keep theirs).
        for st in meta.starts:
            self.handles[(st.req_id, st.attempt)] = self.pub.current_attempts(
                [st.req_id]
            )[0]
        for req_id, attempt, start, n in rows:
            handle = self.handles.get((req_id, attempt), -1)
            self.pub.write_step(np.array([handle]), [start], [n], self.rows(start, n))
        self.pub.flush()
        self.pub.wait_idle(10)
        outputs: dict = defaultdict(list)
        self.sched.update_from_output(self.pub.report(), outputs, self.finish)
        return outputs

    def finish(self, req_ids, status):
        done = []
        for req_id in req_ids:
            request = self.requests.pop(req_id)
            request.status = status
            self.sched.on_finish(request)
            done.append(request)
        return done

    def preempt(self, request) -> None:
        from vllm.v1.request import RequestStatus

        self.sched.on_preempt(request)  # before the blocks are freed
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0

    def published(self, block_hash: bytes) -> bool:
        key = self.keys.key("default", block_hash, B, tail=False)
        return self.writer.lookup([key])[0] is not None

    def close(self) -> None:
        self.sched.close()
        self.pub.close()


@pytest.fixture
def sides(tiny_moe):
    s = TwoSides(tiny_moe)
    yield s
    s.close()


def test_a_block_completed_in_flight_of_a_preempted_attempt_is_published(sides):
    """Defect b: the token that completes block 1 was appended by the step
    before the one whose schedule() preempts the request, so its hash became
    known only then. The old scheduler stopped sending hashes to a preempted
    attempt: the block, computed and cached in the KV cache, never got its
    routes, and a resumed request hitting it failed."""
    r = sides.request("b", 2 * B - 1)
    sides.step(new=[r], rows=[("b", 1, 0, 2 * B - 1)])  # the prefill's rows
    assert sides.published(r.block_hashes[0])
    r.append_output_token_ids(7)  # sampled by the prefill: 2 * B tokens
    r.num_computed_tokens = 2 * B  # its decode is in flight (row 2B - 1)
    assert len(r.block_hashes) == 2
    # The next schedule() preempts it before building the meta; the decode
    # in flight returns its row, tagged with attempt 1.
    sides.preempt(r)
    sides.step(rows=[("b", 1, 2 * B - 1, 1)])
    assert sides.published(r.block_hashes[1])


def test_a_failure_of_a_preempted_attempt_fails_the_request_at_once(sides):
    """Defect e: the old scheduler dropped the failure of an attempt that was
    preempted; a finish of the request then waited 60 s for an
    acknowledgement that never came (ArtifactAckTimeout), and a pause
    blocked as long."""
    from vllm.v1.engine import FinishReason

    r = sides.request("e", B + 4)
    sides.step(new=[r], rows=[("e", 1, 0, B + 4)])
    r.append_output_token_ids(7)
    r.num_computed_tokens = B + 5
    sides.preempt(r)
    # A step in flight returns rows that leave a gap: the attempt fails.
    outputs = sides.step(rows=[("e", 1, B + 6, 1)])
    (out,) = outputs[0]
    assert out.request_id == "e"
    assert out.finish_reason == FinishReason.ERROR
    assert out.artifact_error.startswith("RowGapError"), out.artifact_error
    assert "e" not in sides.requests
    assert sides.sched.stats() == {"records": 0, "ready": 0}
    sides.step()  # the drain and release reach the worker
    assert sides.pub.stats()["attempts"] == 0


class _HeldReader:
    """The store reader with its reads held until ``release`` (a read stuck
    past its request's deadline, as behind a slow store)."""

    def __init__(self, reader) -> None:
        import threading

        self._reader = reader
        self.release = threading.Event()
        self.reading = threading.Event()

    def read_into(self, *args, **kwargs):
        self.reading.set()
        assert self.release.wait(60)
        return self._reader.read_into(*args, **kwargs)

    def close(self) -> None:
        self._reader.close()


def test_a_read_left_by_an_expired_request_is_not_awaited(sides):
    """r5 L7: a request whose read outlived its deadline left with an
    ArtifactReadTimeout, but its read still counted as pending: the finish
    tail's condition (every held request waits for a result: pending ==
    finishing) then failed for every later finishing batch (empty steps
    spun) or held when a request waited for an acknowledgement (the step
    waited for nothing). Pending results are counted per request: the
    expired request's goes when it expires, and its late result, taken
    and dropped, does not count again."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus

    reads = sides.sched._reads
    held = reads._reader = _HeldReader(reads._reader)
    results = sides.sched._results
    r = sides.request("x", B + 4)
    sides.step(new=[r], rows=[("x", 1, 0, B + 4)])
    r.append_output_token_ids(7)
    r.num_computed_tokens = B + 5
    sides.finish(["x"], RequestStatus.FINISHED_LENGTH_CAPPED)
    assert sides.step() == {}  # the finalize is acknowledged: x reads
    assert held.reading.wait(30)
    assert results.pending == 1 == sides.sched._num_finishing
    sides.sched._records["x"].deadline = 0.0  # the read outlived it
    (out,) = sides.step()[0]
    assert out.request_id == "x" and out.finish_reason == FinishReason.ERROR
    assert out.artifact_error.startswith("ArtifactReadTimeout"), out.artifact_error
    assert sides.sched._num_finishing == 0
    assert results.pending == 0
    held.release.set()
    with results._cv:  # the late result is posted
        assert results._cv.wait_for(lambda: results._done, 30)
    assert sides.step() == {}  # taken and dropped
    assert results.pending == 0
    assert sides.sched.stats() == {"records": 0, "ready": 0}


def test_a_prefix_cache_reset_moves_the_keys_unless_the_version_did(sides):
    """r5 H2, the rule (the engine test is in test_r3_shared_kv.py): a
    reset under an unchanged weight version (never set: "default") moves
    the rows to keys of a new cache epoch; a reset after a version change
    keeps the new version's keys (the version already moved them, and an
    engine started with that version derives the same)."""
    from vllm.distributed.artifact_connector.request_core import keyed_version

    def version_after(*calls) -> str:
        for call, *args in calls:
            getattr(sides.sched, call)(*args)
        sides.step()  # the meta carries the version to the worker
        return sides.pub.weight_version

    assert version_after() == "default"
    assert version_after(("reset",)) == keyed_version("default", 1)
    assert keyed_version("default", 1) != "default"
    assert version_after(("reset",)) == keyed_version("default", 2)
    # An RL loop that sets versions, the reset after or before the update.
    assert version_after(("set_weight_version", "v1"), ("reset",)) == "v1"
    assert version_after(("reset",), ("set_weight_version", "v2")) == "v2"
    assert version_after(("reset",)) == "v2"
    # The same weights again (a reset not after an update) still move.
    assert version_after(("reset",)) == keyed_version("v2", 1)
    # Rows published now are found under the keyed version only.
    r = sides.request("k", B + 4)
    sides.step(new=[r], rows=[("k", 1, 0, B + 4)])
    key = sides.keys.key(keyed_version("v2", 1), r.block_hashes[0], B, tail=False)
    assert sides.writer.lookup([key])[0] is not None
    assert not sides.published(r.block_hashes[0])  # not under "default"
