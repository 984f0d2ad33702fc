# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""R3 on vLLM's Prometheus ``/metrics`` of a real ``vllm serve
--enable-routed-experts``: after completions (n = 1 and n = 2), a chat and a
request whose stored routes were corrupted behind the server, the counters
equal what the client saw (choices with routes, 500s naming
ChecksumMismatchError), every read and every acknowledgement is in the
histograms, and the store gauges show the store at rest once the engine is
idle."""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import pytest
from utils.oracle import expected_r3
from utils.r3 import (
    PROMPTS,
    SHARED_PREFIX,
    corrupt_objects,
    http_post,
    r3_server,
    serve_flags,
    shm_root,
    store_objects,
)

pytestmark = pytest.mark.engine

CAPACITY = 64 << 20
P = "vllm:routed_experts_"
ENGINE = {"model_name": "tiny", "engine": "0"}


@pytest.fixture(scope="module")
def server(tiny_moe):
    root = shm_root()
    flags = serve_flags(root, capacity_bytes=CAPACITY)
    with r3_server(tiny_moe, flags, root, "test-r3-metrics.log") as srv:
        yield srv


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    return http_post(server.base_url, path, body)


def _scrape(server) -> dict[tuple[str, frozenset], float]:
    """Every sample of ``/metrics``: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples, name: str, **labels) -> float:
    key = (name, frozenset({**ENGINE, **labels}.items()))
    assert key in samples, f"{name} {labels} not on /metrics"
    return samples[key]


class _Seen:
    """What the client saw: choices with exact routes, and failures."""

    def __init__(self, model):
        self.model = model
        self.routed = 0
        self.failures: dict[str, int] = {}

    def completion(self, server, prompt: str, **kw) -> tuple[int, dict]:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 6,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            **kw,
        }
        status, out = _post(server, "/v1/completions", body)
        if status == 200:
            from vllm.utils.routed_experts_codec import decode_routed_experts

            for choice in out["choices"]:
                got = decode_routed_experts(choice["routed_experts"])
                want = expected_r3(
                    self.model, choice["prompt_token_ids"], choice["token_ids"]
                )
                np.testing.assert_array_equal(got, want)
                self.routed += 1
        else:
            message = out["error"]["message"]
            kind = message.split("routed experts unavailable: ", 1)[1].split(":")[0]
            self.failures[kind] = self.failures.get(kind, 0) + 1
        return status, out


def test_metrics_count_what_the_client_saw(server, tiny_moe):
    before = _scrape(server)
    # Everything is there from the start, at zero, with the engine's labels.
    assert _value(before, P + "requests_routed_total") == 0
    for cause in ("ChecksumMismatchError", "ObjectMissingError", "ArtifactAckTimeout"):
        assert _value(before, P + "request_failures_total", error_type=cause) == 0
    assert _value(before, P + "materialization_seconds_count") == 0

    seen = _Seen(tiny_moe)
    for prompt in PROMPTS[:3]:
        assert seen.completion(server, prompt)[0] == 200
    assert seen.completion(server, PROMPTS[4], n=2, temperature=1.0)[0] == 200
    status, chat = _post(
        server,
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 4,
            "temperature": 0.0,
        },
    )
    assert status == 200 and chat["choices"][0].get("routed_experts"), chat
    seen.routed += 1
    # A request whose routes were corrupted in the store: a 500 for it only.
    victim = SHARED_PREFIX + "These routes get corrupted behind the server."
    assert seen.completion(server, victim)[0] == 200
    corrupt_objects(
        server.shm_root, [place for _, place in store_objects(server.shm_root)]
    )
    status, out = seen.completion(server, victim)
    assert status == 500, out
    assert seen.failures == {"ChecksumMismatchError": 1}
    assert _post(server, "/reset_prefix_cache", {})[0] == 200
    assert seen.completion(server, PROMPTS[3])[0] == 200
    assert seen.routed == 8  # 3 + 2 (n = 2) + chat + victim + 1

    # The counters travel with the outputs' step; the store's gauges with
    # the empty step after the last release. Wait for both (bounded), then
    # compare exactly.
    deadline = time.monotonic() + 60
    while True:
        now = _scrape(server)
        routed = _value(now, P + "requests_routed_total")
        retained = _value(now, P + "store_retained_objects")
        if (routed >= seen.routed and retained == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert routed == seen.routed
    failures = {
        dict(labels)["error_type"]: value
        for (name, labels), value in now.items()
        if name == P + "request_failures_total" and value
    }
    assert failures == seen.failures
    reads = seen.routed + sum(seen.failures.values())
    assert _value(now, P + "materialization_seconds_count") == reads
    assert _value(now, P + "publish_seconds_count") == reads
    assert _value(now, P + "materialization_seconds_sum") > 0
    # The store, at rest.
    assert retained == 0
    assert _value(now, P + "store_capacity_bytes") == CAPACITY
    objects = _value(now, P + "store_objects")
    assert objects == len(store_objects(server.shm_root)) > 0
    assert 0 < _value(now, P + "store_used_bytes") <= CAPACITY
    assert _value(now, P + "store_published_objects_total") >= objects
    assert _value(now, P + "store_evicted_objects_total") == 0
    assert _value(now, P + "store_divergences_total") >= 0
    assert _value(now, P + "publish_queue_depth") >= 0
