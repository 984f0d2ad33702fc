# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The frontend's clean-up after its engine processes were stopped
(``remove_dead_stores``), with a real child process on the real host
transport: an engine core that is still exiting when the clean-up starts
(upstream's shutdown SIGKILLs and does not wait) is waited for, so the
references it left go with it.

The engine manager and the config are stand-ins holding only what the
clean-up reads (``processes``; the artifact config and the data-parallel
size): with a real engine the moment its core finishes exiting cannot be
chosen, and this test needs it to come late."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
from types import SimpleNamespace

import numpy as np

from vllm.config.artifact import ArtifactConfig
from vllm.distributed.artifact_connector.frontend import remove_dead_stores
from vllm.distributed.artifact_connector.route_refs import RouteRefs
from vllm_host_transport.discovery import ScopeDir

EXIT_AFTER_S = 1.0


def _engine_core_exiting_late(scope: str, published) -> None:
    """Hand out a reference, then end without closing anything (as a
    SIGKILL would), ``EXIT_AFTER_S`` after the parent was told."""
    refs = RouteRefs(ArtifactConfig(ref_scope=scope))
    refs.publish(np.ones((4, 2, 2), dtype=np.uint8), 0)
    published.set()
    time.sleep(EXIT_AFTER_S)
    os._exit(0)


def test_a_late_exiting_engine_core_leaves_no_reference_scope():
    scope = f"cleanup-{uuid.uuid4().hex[:10]}"
    path = os.path.join("/dev/shm", ScopeDir.dir_name(scope))
    ctx = mp.get_context("spawn")
    published = ctx.Event()
    core = ctx.Process(target=_engine_core_exiting_late, args=(scope, published))
    core.start()
    try:
        assert published.wait(60), "the engine core stand-in never published"
        assert os.path.isdir(path)
        config = SimpleNamespace(
            artifact_config=ArtifactConfig(
                enable_routed_experts=True,
                shm_root=f"/dev/shm/vart-test-{scope}",  # never created
                ref_scope=scope,
            ),
            parallel_config=SimpleNamespace(data_parallel_size=1),
        )
        remove_dead_stores(config, SimpleNamespace(processes=[core]))
        # Waited for the core rather than finding it alive and leaving its
        # scope (what the clean-up did before it joined the processes).
        assert not core.is_alive()
        assert not os.path.exists(path), os.listdir(path)
    finally:
        core.join(30)
