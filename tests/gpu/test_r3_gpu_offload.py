# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""R3 with CPU KV offload on the GPU (``OffloadingConnector`` and
``SimpleCPUOffloadConnector``, kv_both; they run only on CUDA-like devices,
so not on the CPU harness). A prompt's
blocks leave the 40-block device cache and come back from CPU memory: the
prefix hit they serve must return the routes this engine stored when it
computed them, equal to an engine without offload that recomputes them.
Runs on the GPU harness (``offload_engine.py``, one process per engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
OUT = Path(os.environ.get("OUT", "/tmp")) / "r3_gpu_offload"


def _run(name: str) -> dict:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / f"{name}.log", "wb") as log:
        rc = subprocess.call(
            [sys.executable, str(HERE / "offload_engine.py"), name, str(OUT)],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    assert rc == 0, (OUT / f"{name}.log").read_text()[-3000:]
    return json.loads((OUT / f"offload_{name}.json").read_text())


@pytest.fixture(scope="module")
def plain():
    try:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no GPU")
    except ImportError:
        pytest.skip("no torch")
    return _run("plain")


@pytest.mark.parametrize("connector", ["offload", "simple"])
def test_offloaded_prefix_hit_returns_the_stored_routes(plain, connector):
    offload = _run(connector)
    # Without offload the prompt's blocks were gone: recomputed.
    assert plain["again"]["cached"] == 0
    # With it, its full blocks came back from CPU memory.
    assert offload["again"]["cached"] >= 160, offload["again"]["cached"]
    for run in (offload, plain):
        for r in run.values():
            assert r["error"] is None and r["routes"] is not None, r["error"]
    for when in ("first", "again"):
        got = np.asarray(offload[when]["routes"])
        want = np.asarray(plain[when]["routes"])
        assert got.shape == want.shape == (207, 3, 4)
        assert offload[when]["tokens"] == plain[when]["tokens"]
        # Same batch shapes, same numerics: bit for bit.
        assert (got == want).all(), (when, int((got != want).sum()))
