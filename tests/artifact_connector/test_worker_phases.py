# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker connector's two phases: ``bind`` (the capturer on the routers,
every tensor-parallel rank; Model Runner V2 of vLLM 0.34 calls it in
``profile_run()``) and ``initialize_storage`` (the store and publisher, first
rank only, once the KV cache config is known); ``create`` (0.32's one call)
is both. The capturer and the distributed state are stand-ins here: what is
checked is which phase builds what, that a re-binding keeps the store and
that a second ``initialize_storage`` replaces it instead of opening the same
namespace twice."""

import os
from types import SimpleNamespace

import pytest

import vllm.distributed.parallel_state as parallel_state
import vllm.v1.core.kv_cache_utils as kv_cache_utils
from vllm.config.artifact import ArtifactConfig
from vllm.distributed.artifact_connector import worker
from vllm.distributed.artifact_connector.worker import ArtifactWorkerConnector
from vllm.utils.routed_experts_rows import RowSpec

SPEC = RowSpec(3, 2)
BLOCK = 4


class FakeCapture:
    bound: list = []

    def __init__(self, model, vllm_config, spec):
        self.spec = spec
        FakeCapture.bound.append(model)


@pytest.fixture
def setup(shm_root, monkeypatch):
    FakeCapture.bound = []
    rank = SimpleNamespace(is_first_rank=True)
    monkeypatch.setattr(worker, "CaptureState", FakeCapture)
    monkeypatch.setattr(worker, "routed_experts_row_spec", lambda cfg: SPEC)
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: rank)
    monkeypatch.setattr(
        kv_cache_utils, "resolve_kv_cache_block_sizes", lambda kv, cfg: (BLOCK, BLOCK)
    )
    cfg = SimpleNamespace(
        artifact_config=ArtifactConfig(
            enable_routed_experts=True, shm_root=shm_root, capacity_bytes=1 << 20
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64),
        parallel_config=SimpleNamespace(data_parallel_rank=0),
        max_concurrent_batches=1,
    )
    return cfg, rank


def test_bind_then_storage(setup, shm_root):
    cfg, _ = setup
    conn = ArtifactWorkerConnector.bind("model", cfg)
    assert FakeCapture.bound == ["model"]
    assert conn._publisher is None  # no store before the KV cache exists
    assert not os.path.exists(shm_root)
    conn.initialize_storage(kv_cache_config=None)
    first = conn._publisher
    assert first is not None and os.listdir(shm_root)
    # A second profiling run binds the routers again; the store carries over.
    again = ArtifactWorkerConnector.bind("model-2", cfg, conn)
    assert FakeCapture.bound == ["model", "model-2"]
    assert again._publisher is first and conn._publisher is None
    # Storage initialized again: the old publisher (same namespace) goes first.
    again.initialize_storage(kv_cache_config=None)
    assert again._publisher is not None and again._publisher is not first
    assert first._publication._closed
    again.close()
    assert again._publisher is None


def test_other_ranks_bind_only(setup, shm_root):
    cfg, rank = setup
    rank.is_first_rank = False
    conn = ArtifactWorkerConnector.bind("model", cfg)
    conn.initialize_storage(kv_cache_config=None)
    assert FakeCapture.bound == ["model"]
    assert conn._publisher is None and not os.path.exists(shm_root)


def test_create_is_both_phases(setup, shm_root):
    cfg, _ = setup
    conn = ArtifactWorkerConnector.create("model", cfg, kv_cache_config=None)
    assert FakeCapture.bound == ["model"]
    assert conn._publisher is not None and os.listdir(shm_root)
    conn.close()


def test_storage_needs_a_bound_connector():
    conn = ArtifactWorkerConnector(capture=None, publisher=None)
    with pytest.raises(RuntimeError, match="bind"):
        conn.initialize_storage(kv_cache_config=None)
