# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""R3 under load: a real ``vllm serve --enable-routed-experts`` on the CPU
harness with a KV cache small enough to preempt, driven by many concurrent
requests of every kind at once, every returned array checked against
transformers' router.

The mix (drawn from a fixed seed): completions and token-in/token-out
requests on a few shared prefixes, streamed and not, some with ``n=2`` and
some with ``routed_experts_prompt_start``; chat completions; stop strings;
two-turn conversations (turn 2 continues turn 1's prompt and output, and its
leading rows must equal turn 1's whole array); and requests the client hangs
up on mid-stream (the server aborts them).

``make test`` runs ``R3_LOAD_REQUESTS`` (default 100) requests; ``make soak``
runs 500. Afterwards ``/metrics`` must agree with what the clients saw
(routed requests, no failures) and show nothing retained in the store; the
fixture checks that the store is gone after shutdown. The figures
(requests, aborts, preemptions, divergences, errors by cause, wall time) are
printed and written to ``.cache/logs/r3-load-summary.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from utils.oracle import expected_r3
from utils.r3 import BLOCK_SIZE, PROMPTS, shm_root

pytestmark = pytest.mark.engine

NUM_REQUESTS = int(os.environ.get("R3_LOAD_REQUESTS", "100"))
SEED = int(os.environ.get("R3_LOAD_SEED", "20261130"))
MAX_NUM_SEQS = 16
# 24 blocks of 32 tokens: far fewer than 16 running requests of up to ~230
# tokens need. The scheduler admits requests while their prompts fit, and
# the running ones then grow by up to 40 new tokens each: it must preempt.
NUM_KV_BLOCKS = 24
KINDS = {  # kind: weight
    "completion": 4,
    "completion_stream": 4,
    "tito": 2,
    "tito_stream": 1,
    "chat": 1,
    "chat_stream": 1,
    "stop": 2,
    "two_turns": 2,
    "hang_up": 2,
}


@pytest.fixture(scope="module")
def server(tiny_moe):
    from server import VllmServer

    root = shm_root()
    flags = [
        "--served-model-name", "tiny", "--enable-routed-experts",
        "--enable-scale-out", "--dtype", "float32",
        "--block-size", str(BLOCK_SIZE), "--max-model-len", "512",
        "--max-num-seqs", str(MAX_NUM_SEQS),
        "--num-gpu-blocks-override", str(NUM_KV_BLOCKS),
        "--max-num-batched-tokens", "128", "--enforce-eager",
        "--artifact-config", json.dumps({"shm_root": root}),
        "--shutdown-timeout", "30",
    ]  # fmt: skip
    with VllmServer(tiny_moe, flags, log_name="test-r3-load.log") as srv:
        srv.shm_root = root
        yield srv
    assert not os.path.exists(root), "the store outlived a clean shutdown"


# ------------------------------------------------------------------ results
@dataclass
class Choice:
    """One returned sequence: what the oracle needs and what came back."""

    prompt_ids: list[int]
    token_ids: list[int]
    routes: np.ndarray
    first_row: int = 0
    finish_reason: str | None = None


@dataclass
class Outcome:
    kind: str
    choices: list[Choice] = field(default_factory=list)
    error: str | None = None  # HTTP status / error event, for the report
    hung_up: bool = False
    # two_turns: (turn 1's whole array, turn 2's choice)
    turns: tuple[np.ndarray, Choice] | None = None


def _decode(b64: str) -> np.ndarray:
    from vllm.utils.routed_experts_codec import decode_routed_experts

    return decode_routed_experts(b64)


class _Stream:
    """Per choice index of one stream: token IDs and the final chunk's
    routes; chunks before the final one must carry no routes."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.final: dict[int, dict] = {}
        self.prompt_ids: list[int] | None = None
        self.error: str | None = None

    def add(self, event: dict) -> None:
        if "error" in event:
            self.error = f"{event['error'].get('code')}: {event['error']['message']}"
            return
        self.prompt_ids = event.get("prompt_token_ids") or self.prompt_ids
        for c in event.get("choices", []):
            i = c["index"]
            assert i not in self.final, f"choice {i} went on after its final chunk"
            self.prompt_ids = c.get("prompt_token_ids") or self.prompt_ids
            self.tokens.setdefault(i, []).extend(c.get("token_ids") or [])
            if c.get("finish_reason") is None:
                assert c.get("routed_experts") is None, "routes before the end"
            else:
                self.final[i] = c

    def choices(self, prompt_ids: list[int] | None, first_row: int) -> list[Choice]:
        ids = prompt_ids if prompt_ids is not None else self.prompt_ids
        assert ids is not None, "no prompt token IDs in the stream"
        return [
            Choice(
                list(ids),
                self.tokens[i],
                _decode(c["routed_experts"]),
                first_row,
                c["finish_reason"],
            )
            for i, c in sorted(self.final.items())
        ]


# ------------------------------------------------------------------ client
class Load:
    def __init__(self, server, rng: np.random.Generator) -> None:
        self.url = server.base_url
        self.rng = rng
        vocab_lo, vocab_hi = 10, 500
        # Four shared prefixes of 2-4 blocks; prompts add 1-60 own tokens.
        self.prefixes = [
            rng.integers(vocab_lo, vocab_hi, int(n) * BLOCK_SIZE).tolist()
            for n in rng.integers(2, 5, 4)
        ]
        self.vocab = (vocab_lo, vocab_hi)

    def token_prompt(self) -> list[int]:
        prefix = self.prefixes[int(self.rng.integers(len(self.prefixes)))]
        own = self.rng.integers(*self.vocab, int(self.rng.integers(1, 61))).tolist()
        return prefix + own

    def sampling(self) -> dict:
        n = int(self.rng.choice([1, 1, 2]))
        sp = {
            "max_tokens": int(self.rng.integers(2, 41)),
            "ignore_eos": True,
            "n": n,
            "temperature": 0.8 if n > 1 else 0.0,
            "seed": int(self.rng.integers(1 << 30)),
        }
        if self.rng.random() < 0.3:
            sp["routed_experts_prompt_start"] = int(self.rng.integers(0, 40))
        return sp

    # -------------------------------------------------------------- kinds
    async def run(self, http, kind: str) -> Outcome:
        out = Outcome(kind)
        try:
            await getattr(self, kind)(http, out)
        except _Failed as e:
            out.error = str(e)
        return out

    async def completion(self, http, out: Outcome, stream: bool = False) -> None:
        ids, sp = self.token_prompt(), self.sampling()
        body = {"model": "tiny", "prompt": ids, "return_token_ids": True, **sp}
        start = min(sp.get("routed_experts_prompt_start", 0), len(ids))
        if stream:
            s = await self._sse(http, "/v1/completions", body)
            out.choices = s.choices(ids, start)
            return
        resp = await self._post(http, "/v1/completions", body)
        out.choices = [
            Choice(
                c["prompt_token_ids"],
                c["token_ids"],
                _decode(c["routed_experts"]),
                start,
                c["finish_reason"],
            )
            for c in resp["choices"]
        ]

    async def completion_stream(self, http, out: Outcome) -> None:
        await self.completion(http, out, stream=True)

    async def tito(self, http, out: Outcome, stream: bool = False) -> None:
        ids, sp = self.token_prompt(), self.sampling()
        sp.pop("routed_experts_prompt_start", None)
        start = int(self.rng.integers(0, len(ids) + 1))
        sp["routed_experts_prompt_start"] = start
        body = {"token_ids": ids, "sampling_params": sp}
        if stream:
            s = await self._sse(http, "/inference/v1/generate", body)
            out.choices = s.choices(ids, start)
            return
        resp = await self._post(http, "/inference/v1/generate", body)
        out.choices = [
            Choice(
                ids,
                c["token_ids"],
                _decode(c["routed_experts"]),
                start,
                c.get("finish_reason"),
            )
            for c in resp["choices"]
        ]

    async def tito_stream(self, http, out: Outcome) -> None:
        await self.tito(http, out, stream=True)

    async def chat(self, http, out: Outcome, stream: bool = False) -> None:
        text = PROMPTS[int(self.rng.integers(len(PROMPTS)))]
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": int(self.rng.integers(2, 13)),
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if stream:
            s = await self._sse(http, "/v1/chat/completions", body)
            out.choices = s.choices(None, 0)
            return
        resp = await self._post(http, "/v1/chat/completions", body)
        (c,) = resp["choices"]
        out.choices = [
            Choice(
                resp["prompt_token_ids"],
                c["token_ids"],
                _decode(c["routed_experts"]),
                0,
                c["finish_reason"],
            )
        ]

    async def chat_stream(self, http, out: Outcome) -> None:
        await self.chat(http, out, stream=True)

    async def stop(self, http, out: Outcome) -> None:
        """Single-letter stop strings: most requests stop on one within a
        few tokens, cut by the frontend."""
        ids = self.token_prompt()
        body = {
            "model": "tiny",
            "prompt": ids,
            "max_tokens": 24,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stop": ["e", "o"],
        }
        if self.rng.random() < 0.5:
            s = await self._sse(http, "/v1/completions", body)
            out.choices = s.choices(ids, 0)
            return
        (c,) = (await self._post(http, "/v1/completions", body))["choices"]
        routes = _decode(c["routed_experts"])
        out.choices = [Choice(ids, c["token_ids"], routes, 0, c["finish_reason"])]

    async def two_turns(self, http, out: Outcome) -> None:
        ids = self.token_prompt()
        body = {
            "model": "tiny",
            "prompt": ids,
            "max_tokens": int(self.rng.integers(2, 13)),
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        (c1,) = (await self._post(http, "/v1/completions", body))["choices"]
        turn1 = Choice(ids, c1["token_ids"], _decode(c1["routed_experts"]))
        more = self.rng.integers(*self.vocab, int(self.rng.integers(1, 40))).tolist()
        ids2 = ids + c1["token_ids"] + more
        (c2,) = (await self._post(http, "/v1/completions", {**body, "prompt": ids2}))[
            "choices"
        ]
        turn2 = Choice(ids2, c2["token_ids"], _decode(c2["routed_experts"]))
        out.choices = [turn1, turn2]
        out.turns = (turn1.routes, turn2)

    async def hang_up(self, http, out: Outcome) -> None:
        body = {
            "model": "tiny",
            "prompt": self.token_prompt(),
            "max_tokens": 64,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        chunks = int(self.rng.integers(1, 4))
        async with http.stream("POST", self.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise _Failed(f"{r.status_code}: {(await r.aread())[:300]!r}")
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= chunks:
                        break  # closing the response aborts the request
        out.hung_up = True

    # -------------------------------------------------------------- HTTP
    async def _post(self, http, path: str, body: dict) -> dict:
        r = await http.post(self.url + path, json=body)
        if r.status_code != 200:
            raise _Failed(f"{r.status_code}: {r.text[:300]}")
        return r.json()

    async def _sse(self, http, path: str, body: dict) -> _Stream:
        s = _Stream()
        async with http.stream(
            "POST", self.url + path, json={**body, "stream": True}
        ) as r:
            if r.status_code != 200:
                raise _Failed(f"{r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    s.add(json.loads(line[len("data: ") :]))
        if s.error is not None:
            raise _Failed(s.error)
        return s


class _Failed(Exception):
    pass


async def _drive(server, kinds: list[str], rng) -> tuple[list[Outcome], float]:
    import httpx

    load = Load(server, rng)
    limits = httpx.Limits(max_connections=len(kinds) + 8)
    async with httpx.AsyncClient(timeout=900, limits=limits) as http:
        t0 = time.monotonic()
        outs = await asyncio.gather(*(load.run(http, k) for k in kinds))
        return list(outs), time.monotonic() - t0


def _metric(server, name: str) -> float:
    """The sum of a Prometheus metric's samples (all label sets)."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


# Counters read before and after the load; the test reports their growth.
COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:routed_experts_requests_routed_total",
    "vllm:routed_experts_request_failures_total",
    "vllm:routed_experts_store_divergences_total",
    "vllm:routed_experts_store_evicted_objects_total",
)


def _wait_for_metric(server, name: str, value: float, timeout_s: float = 30) -> float:
    """Poll until ``name`` reads ``value`` (the worker's store gauges are
    refreshed at most once a second); returns the last reading."""
    deadline = time.monotonic() + timeout_s
    while (got := _metric(server, name)) != value and time.monotonic() < deadline:
        time.sleep(0.5)
    return got


def _error_cause(error: str) -> str:
    m = re.search(r"routed experts unavailable: (\w+)", error)
    return m.group(1) if m else error.split(":", 1)[0]


# -------------------------------------------------------------------- test
def test_concurrent_mixed_load_is_exact(server, tiny_moe):
    rng = np.random.default_rng(SEED)
    names, weights = zip(*KINDS.items())
    p = np.array(weights, dtype=float) / sum(weights)
    kinds = [str(k) for k in rng.choice(names, size=NUM_REQUESTS, p=p)]
    before = {name: _metric(server, name) for name in COUNTERS}

    outcomes, wall_s = asyncio.run(_drive(server, kinds, rng))

    # Every returned array, row by row, against transformers' router.
    t = time.monotonic()
    checked = stops = 0
    for o in outcomes:
        for c in o.choices:
            want = expected_r3(tiny_moe, c.prompt_ids, c.token_ids)
            np.testing.assert_array_equal(
                c.routes, want[c.first_row :], err_msg=f"{o.kind}: routes differ"
            )
            checked += 1
            stops += c.finish_reason == "stop"
        if o.turns is not None:
            turn1, turn2 = o.turns
            np.testing.assert_array_equal(turn2.routes[: len(turn1)], turn1)
    oracle_s = time.monotonic() - t

    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error is not None:
            cause = _error_cause(o.error)
            errors[cause] = errors.get(cause, 0) + 1
    grew = {n: _metric(server, n) - before[n] for n in COUNTERS}
    hung_up = sum(o.hung_up for o in outcomes)
    summary = {
        "requests": len(outcomes),
        "by_kind": {k: kinds.count(k) for k in KINDS},
        "sequences_checked": checked,
        "stopped_by_stop_string": stops,
        "hung_up": hung_up,
        "preemptions": grew["vllm:num_preemptions_total"],
        "errors_by_cause": errors,
        "metrics_routed": grew["vllm:routed_experts_requests_routed_total"],
        "metrics_failures": grew["vllm:routed_experts_request_failures_total"],
        "divergences": grew["vllm:routed_experts_store_divergences_total"],
        "evictions": grew["vllm:routed_experts_store_evicted_objects_total"],
        "retained_after": _wait_for_metric(
            server, "vllm:routed_experts_store_retained_objects", 0
        ),
        "wall_s": round(wall_s, 1),
        "oracle_s": round(oracle_s, 1),
    }
    print("R3_LOAD " + json.dumps(summary))
    out = Path(__file__).resolve().parent.parent / ".cache" / "logs"
    out.mkdir(parents=True, exist_ok=True)
    (out / "r3-load-summary.json").write_text(json.dumps(summary, indent=1))

    assert errors == {}, [o.error for o in outcomes if o.error][:5]
    assert summary["preemptions"] > 0, "the KV cache was large enough"
    assert hung_up == kinds.count("hang_up")
    assert checked >= NUM_REQUESTS - hung_up
    # /metrics agrees with what the clients saw: every returned sequence
    # had routes, and nothing was read for a client that hung up (its abort
    # reaches the engine as one whose caller is gone).
    assert summary["metrics_routed"] == checked, summary
    assert summary["metrics_failures"] == 0, summary
    # Once idle, no request holds anything in the store.
    assert summary["retained_after"] == 0, summary
    # The server is still exact afterwards.
    with urllib.request.urlopen(server.base_url + "/health", timeout=30) as r:
        assert r.status == 200
