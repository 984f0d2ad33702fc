# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trainer ranks reading their slices of the same references (issue 38).

A real ``vllm serve`` of an 8-layer tiny MoE whose layers 0 and 5 are
dense hands out references (once over the host transport, once through a
real ``mooncake_master``); 8 trainer processes (4 pipeline stages x 2
data-parallel halves, ``tests/utils/slice_readers.py``, importing
``vllm_host_transport`` only) read them at once, each the MoE layers of its
stage (taken from the model's config) of the references of its half,
packed, layer-major, int64. Every slice must equal the same slice of
transformers' router in float32 and of the inline routes of the same
request; each rank must read exactly its bytes plus the headers; the last
stage of each half removes what it read, after which a read fails at once
with ``RouteRefMissingError``. References carry the weight version the
rows were computed under, and those of retired versions go."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from utils.oracle import expected_r3
from utils.r3 import PROMPTS, http_post, ref_server
from utils.routes_consumer import Consumer
from utils.slice_readers import check

pytestmark = pytest.mark.engine

STAGES, HALVES = 4, 2
DENSE = (0, 5)
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def model8():
    from build_tiny_moe import TinyMoEParams, build
    from harness_env import CACHE

    params = TinyMoEParams(layers=8, dense_layers=list(DENSE))
    return build(CACHE / "models" / "tiny-moe-8l-dense", params)


@pytest.fixture(scope="module", params=["host", "mooncake"])
def server(request, model8):
    with ref_server(model8, request.param, "slices", ref_versions_kept=2) as srv:
        yield srv


def _complete(server, prompt: str, **kw) -> dict:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **kw,
    }
    status, out = http_post(server.base_url, "/v1/completions", body)
    assert status == 200, out
    return out["choices"][0]


def _read_slices(tmp_path: Path, refs: list[dict], model, release: bool) -> list:
    job = {
        "refs": refs,
        "config": str(model),
        "stages": STAGES,
        "halves": HALVES,
        "out": str(tmp_path),
        "release": release,
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MC_FORCE_TCP"] = "true"
    done = subprocess.run(
        [sys.executable, str(HERE / "utils" / "slice_readers.py"), str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def consumer(tmp_path_factory):
    # Reads and releases in a process of their own, never in this one.
    c = Consumer(tmp_path_factory.mktemp("consumer"))
    yield c
    c.close()


def test_eight_ranks_read_their_slices_at_once(server, consumer, model8, tmp_path):
    prompts = [PROMPTS[i % len(PROMPTS)] * (1 + i % 3) for i in range(6)]
    choices = [_complete(server, p) for p in prompts]
    inline = [
        _complete(server, p, routed_experts_format="inline")["routed_experts"]
        for p in prompts
    ]
    refs = [c["routed_experts_ref"] for c in choices]
    want = [expected_r3(model8, c["prompt_token_ids"], c["token_ids"]) for c in choices]
    for ref in refs:
        assert ref["weight_version"] == "default" and ref["format"] == 2
    answers = _read_slices(tmp_path, refs, model8, release=True)
    assert len(answers) == STAGES * HALVES
    check(answers, refs, want, str(tmp_path), HALVES)
    check(answers, refs, [_decode_inline(x) for x in inline], str(tmp_path), HALVES)
    seen = set()
    for a in answers:
        layers = np.load(tmp_path / f"rank-{a['stage']}-{a['half']}.npz")["layers"]
        seen |= {int(x) for x in layers}
    # Every MoE layer is some stage's, no dense layer is anyone's.
    assert seen == set(range(8)) - set(DENSE)
    for ref in refs:
        start = time.monotonic()
        assert consumer.fetch(ref) == "RouteRefMissingError"
        assert time.monotonic() - start < 1.0


def _decode_inline(value) -> np.ndarray:
    import base64
    import io

    return np.load(io.BytesIO(base64.b64decode(value)))


def test_weight_versions_travel_and_old_ones_retire(server, consumer):
    def update(version: str) -> None:
        status, out = http_post(
            server.base_url, "/update_weight_version", {"new_version": version}
        )
        assert status == 200, out

    old = _complete(server, PROMPTS[1])["routed_experts_ref"]
    update("step-1")
    one = _complete(server, PROMPTS[2])["routed_experts_ref"]
    assert one["weight_version"] == "step-1"
    # Two versions are kept: both still readable.
    assert isinstance(consumer.fetch(old), np.ndarray)
    update("step-2")
    two = _complete(server, PROMPTS[3])["routed_experts_ref"]
    assert two["weight_version"] == "step-2"
    # The first version left the last two: its references go (on the
    # hand-off thread, at once).
    deadline = time.monotonic() + 10
    while consumer.fetch(old) != "RouteRefMissingError":
        assert time.monotonic() < deadline, "old version's reference still readable"
        time.sleep(0.1)
    assert isinstance(consumer.fetch(one), np.ndarray)
    assert isinstance(consumer.fetch(two), np.ndarray)
    # The driver's release: gone for every reader, at once.
    assert consumer.release([one, two]) == 2
    for ref in (one, two):
        assert consumer.fetch(ref) == "RouteRefMissingError"
    assert consumer.release([one]) == 0  # releasing twice is not an error
