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
leading rows must equal turn 1's whole array); requests the client hangs up
on mid-stream (the server aborts them); and requests aborted by id while
they run (``POST /abort_requests`` for completions, the token-in/token-out
abort). Meanwhile a controller, like an RL loop between rollout steps,
pauses with abort, sets a new weight version, resumes (the pause clears the
prefix cache), or aborts everything in flight (``POST /abort_requests {}``).
An aborted request must come back with the routes of exactly the tokens it
returned, or with none and ``RequestAbortedError`` when it had returned no
token.

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
from utils.r3 import BLOCK_SIZE, PROMPTS, r3_server, shm_root

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
    "abort_by_id": 2,
    "tito_abort": 1,
}
# The controller's actions: a pause-with-abort cycle with a new weight
# version, or an abort of everything in flight; one every 8-16 s. Requests
# arrive over ARRIVAL_S_PER_REQUEST * NUM_REQUESTS seconds, so each action
# meets only what is in flight then.
CONTROLLER_ACTIONS = {"pause_new_version_resume": 2, "abort_all": 1}
CONTROLLER_EVERY_S = (8.0, 16.0)
ARRIVAL_S_PER_REQUEST = 0.2


@pytest.fixture(scope="module")
def server(tiny_moe):
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
    # The RL endpoints (/pause, /resume, /update_weight_version) too.
    with r3_server(tiny_moe, flags, root, "test-r3-load.log") as srv:
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
    # Choices aborted before their first token (no routes, and why).
    aborted_early: int = 0


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

    def raw_choices(self, prompt_ids: list[int] | None, out: Outcome) -> list[dict]:
        """Each choice's final chunk, with the streamed token IDs and the
        prompt's. The base's streams send no chunk at all for a request that
        ends without any token (an abort before the first): counted as
        such."""
        if not self.final and not any(self.tokens.values()):
            out.aborted_early += 1
            return []
        ids = prompt_ids if prompt_ids is not None else self.prompt_ids
        assert ids is not None, "no prompt token IDs in the stream"
        return [
            {**c, "token_ids": self.tokens[i], "prompt_token_ids": list(ids)}
            for i, c in sorted(self.final.items())
        ]


# ------------------------------------------------------------------ client
class Load:
    def __init__(self, server, rng: np.random.Generator) -> None:
        self.url = server.base_url
        self.rng = rng
        self.ids_used = 0
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

    @staticmethod
    def _choices(out: Outcome, raw: list[dict], ids, start: int) -> list[Choice]:
        """Choices of a response; one aborted before its first token carries
        no routes and must say why."""
        kept = []
        for c in raw:
            if c.get("routed_experts") is None and c.get("finish_reason") == "abort":
                reason = c.get("routed_experts_error") or ""
                assert not c.get("token_ids"), f"tokens without routes: {c}"
                assert reason.startswith("RequestAbortedError"), (out.kind, c)
                out.aborted_early += 1
                continue
            kept.append(
                Choice(
                    list(ids if ids is not None else c["prompt_token_ids"]),
                    c["token_ids"],
                    _decode(c["routed_experts"]),
                    start,
                    c.get("finish_reason"),
                )
            )
        return kept

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
            out.choices = self._choices(out, s.raw_choices(ids, out), None, start)
            return
        resp = await self._post(http, "/v1/completions", body)
        out.choices = self._choices(out, resp["choices"], None, start)

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
            out.choices = self._choices(out, s.raw_choices(ids, out), None, start)
            return
        resp = await self._post(http, "/inference/v1/generate", body)
        out.choices = self._choices(out, resp["choices"], ids, start)

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
            out.choices = self._choices(out, s.raw_choices(None, out), None, 0)
            return
        resp = await self._post(http, "/v1/chat/completions", body)
        out.choices = self._choices(out, resp["choices"], resp["prompt_token_ids"], 0)

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
            out.choices = self._choices(out, s.raw_choices(ids, out), None, 0)
            return
        resp = await self._post(http, "/v1/completions", body)
        out.choices = self._choices(out, resp["choices"], ids, 0)

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
        resp = await self._post(http, "/v1/completions", body)
        turn1 = self._choices(out, resp["choices"], ids, 0)
        if not turn1:  # aborted before its first token
            return
        more = self.rng.integers(*self.vocab, int(self.rng.integers(1, 40))).tolist()
        ids2 = ids + turn1[0].token_ids + more
        resp = await self._post(http, "/v1/completions", {**body, "prompt": ids2})
        turn2 = self._choices(out, resp["choices"], ids2, 0)
        out.choices = turn1 + turn2
        if turn2:
            out.turns = (turn1[0].routes, turn2[0])

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

    async def abort_by_id(self, http, out: Outcome) -> None:
        """A completion the client aborts by the id it chose (X-Request-Id;
        prompt 0 of it is ``cmpl-<id>-0``) while it runs."""
        self.ids_used += 1
        rid = f"load-abort-{self.ids_used}"
        ids = self.token_prompt()
        body = {
            "model": "tiny", "prompt": ids, "max_tokens": 40, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True,
        }  # fmt: skip
        request = asyncio.create_task(
            self._post(http, "/v1/completions", body, {"X-Request-Id": rid})
        )
        await asyncio.sleep(float(self.rng.uniform(0.05, 3.0)))
        await self._post(http, "/abort_requests", {"request_ids": [f"cmpl-{rid}-0"]})
        out.choices = self._choices(out, (await request)["choices"], ids, 0)

    async def tito_abort(self, http, out: Outcome) -> None:
        """A token-in/token-out request aborted through its own endpoint."""
        self.ids_used += 1
        rid = f"load-tito-{self.ids_used}"
        ids = self.token_prompt()
        body = {
            "token_ids": ids,
            "request_id": rid,
            "sampling_params": {
                "max_tokens": 40,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        }
        request = asyncio.create_task(self._post(http, "/inference/v1/generate", body))
        await asyncio.sleep(float(self.rng.uniform(0.05, 3.0)))
        await http.post(
            self.url + "/inference/v1/abort_requests",
            json={"request_ids": [f"generate-tokens-{rid}"]},
        )
        out.choices = self._choices(out, (await request)["choices"], ids, 0)

    # -------------------------------------------------------------- HTTP
    async def _post(self, http, path: str, body: dict, headers=None) -> dict:
        r = await http.post(self.url + path, json=body, headers=headers)
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
            # Lines end at "\n" only: aiter_lines also splits at U+0085,
            # U+2028 and the like, which a tiny model's raw text can hold
            # unescaped inside a JSON string.
            pending = b""
            async for chunk in r.aiter_bytes():
                *lines, pending = (pending + chunk).split(b"\n")
                for raw in lines:
                    line = raw.decode().rstrip("\r")
                    if line.startswith("data: ") and line != "data: [DONE]":
                        s.add(json.loads(line[len("data: ") :]))
        if s.error is not None:
            raise _Failed(s.error)
        return s


class _Failed(Exception):
    pass


async def _control(server, http, rng, done: asyncio.Event, actions: dict) -> None:
    """What an RL loop does between rollout steps, while the load runs."""
    url = server.base_url
    names, weights = zip(*CONTROLLER_ACTIONS.items())
    p = np.array(weights, dtype=float) / sum(weights)
    while not done.is_set():
        try:
            await asyncio.wait_for(done.wait(), float(rng.uniform(*CONTROLLER_EVERY_S)))
            return
        except asyncio.TimeoutError:
            pass
        action = str(rng.choice(names, p=p))
        actions[action] = actions.get(action, 0) + 1
        if action == "abort_all":
            r = await http.post(url + "/abort_requests", json={})
            assert r.status_code == 200, r.text
            continue
        r = await http.post(url + "/pause?mode=abort")  # clears the prefix cache
        assert r.status_code == 200, r.text
        version = f"load-{actions[action]}"
        r = await http.post(
            url + "/update_weight_version", json={"new_version": version}
        )
        assert r.status_code == 200, r.text
        r = await http.post(url + "/resume")
        assert r.status_code == 200, r.text


async def _drive(
    server, kinds: list[str], rng, control_rng
) -> tuple[list[Outcome], float, dict]:
    import httpx

    load = Load(server, rng)
    limits = httpx.Limits(max_connections=len(kinds) + 8)
    actions: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=900, limits=limits) as http:
        t0 = time.monotonic()
        done = asyncio.Event()
        control = asyncio.create_task(
            _control(server, http, control_rng, done, actions)
        )
        arrivals = rng.uniform(0, ARRIVAL_S_PER_REQUEST * len(kinds), len(kinds))

        async def arrive(kind: str, at: float) -> Outcome:
            await asyncio.sleep(at)
            return await load.run(http, kind)

        outs = await asyncio.gather(*(arrive(k, a) for k, a in zip(kinds, arrivals)))
        done.set()
        await control
        return list(outs), time.monotonic() - t0, actions


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

    outcomes, wall_s, actions = asyncio.run(
        _drive(server, kinds, rng, np.random.default_rng(SEED + 1))
    )

    # Every returned array, row by row, against transformers' router.
    t = time.monotonic()
    checked = stops = aborted = 0
    for o in outcomes:
        for c in o.choices:
            aborted += c.finish_reason == "abort"
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
        "aborted_with_routes": aborted,
        "aborted_before_first_token": sum(o.aborted_early for o in outcomes),
        "controller_actions": actions,
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
    # Every request the client waited for came back: each choice with its
    # routes, or aborted before its first token saying why.
    unanswered = [
        o.kind
        for o in outcomes
        if not (o.choices or o.aborted_early or o.hung_up or o.error)
    ]
    assert unanswered == [], unanswered
    # /metrics agrees with what the clients saw: every returned sequence
    # had routes. Nothing is read for a client that hung up (its abort
    # reaches the engine as one whose caller is gone), unless its request
    # finished before the server noticed the hang-up.
    assert checked <= summary["metrics_routed"] <= checked + hung_up, summary
    assert summary["metrics_failures"] == 0, summary
    # Once idle, no request holds anything in the store.
    assert summary["retained_after"] == 0, summary
    # The server is still exact afterwards.
    with urllib.request.urlopen(server.base_url + "/health", timeout=30) as r:
        assert r.status == 200
