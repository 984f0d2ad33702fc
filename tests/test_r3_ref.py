# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routes by reference (``routed_experts_format="ref"``): a real ``vllm
serve`` (once with the same-node host transport, once with a Mooncake Store
behind a real ``mooncake_master``), a real ``LLM``, and a separate consumer
process that imports ``vllm_host_transport.routed_experts`` (and Mooncake's
client) only, checks that neither vLLM nor torch is loaded, and fetches each
reference. Every fetched array is checked against transformers' router in
float32."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import stat
import threading
import time
import uuid

import numpy as np
import pytest
from utils.oracle import expected_r3
from utils.r3 import (
    PROMPTS,
    SHARED_PREFIX,
    engine_kwargs,
    greedy,
    http_post,
    r3_server,
    ref_server,
    serve_flags,
    shm_root,
)
from utils.routes_consumer import Consumer

pytestmark = pytest.mark.engine

TTL_S = 3.0


@pytest.fixture(scope="module")
def consumer(tmp_path_factory):
    c = Consumer(tmp_path_factory.mktemp("consumer"))
    yield c
    c.close()


def _scope_name(scope: str) -> str:
    from vllm_host_transport.discovery import ScopeDir

    return ScopeDir.dir_name(scope)


def _assert_ref_exact(consumer, tiny_moe, ref, prompt_ids, token_ids, first_row=0):
    assert ref is not None
    assert ref["transport"] in ("host", "mooncake")
    assert ref["prompt_start"] == first_row
    got = consumer.fetch(ref)
    assert isinstance(got, np.ndarray), (got, getattr(consumer, "last_message", ""))
    want = expected_r3(tiny_moe, prompt_ids, token_ids)[first_row:]
    assert got.dtype == np.uint8 and list(ref["shape"]) == list(want.shape)
    np.testing.assert_array_equal(got, want)
    assert got.any()  # not a zero-filled answer
    return got


# ------------------------------------------------------------------ HTTP
@pytest.fixture(scope="module")
def scope():
    return f"r3ref-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module", params=["host", "mooncake"])
def server(request, tiny_moe, scope):
    with ref_server(
        tiny_moe, request.param, "ref", ref_scope=scope, ref_ttl_s=TTL_S
    ) as srv:
        yield srv
    # Everything the engine handed out is removed when it stops.
    _assert_no_payloads_left(scope)


def _assert_no_payloads_left(scope: str) -> None:
    assert _payload_files(os.path.join("/dev/shm", _scope_name(scope))) == []


def _payload_files(path: str) -> list[str]:
    """What producers left in a scope directory: rings, per-key segments,
    read-many objects, registrations."""
    left = os.listdir(path) if os.path.exists(path) else []
    return [
        n
        for n in left
        if n.startswith(("ring-", "member-")) or n.endswith((".seg", ".rdm"))
    ]


def _host_only(server) -> None:
    if server.transport != "host":
        pytest.skip("host-transport semantics (the scope's files)")


def _post(server, path, body):
    status, out = http_post(server.base_url, path, body)
    assert status == 200, out
    return out


def _completion(server, prompt, **kw):
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **kw,
    }
    return _post(server, "/v1/completions", body)


def test_completion_chat_and_tito_by_reference(server, consumer, tiny_moe):
    body = _completion(server, SHARED_PREFIX + "First.")
    (choice,) = body["choices"]
    assert choice["routed_experts"] is None  # no base64 through the API server
    _assert_ref_exact(
        consumer,
        tiny_moe,
        choice["routed_experts_ref"],
        choice["prompt_token_ids"],
        choice["token_ids"],
    )
    chat = _post(
        server,
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Capital of France?"}],
            "max_tokens": 8,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    (c,) = chat["choices"]
    assert c["routed_experts"] is None
    _assert_ref_exact(
        consumer, tiny_moe, c["routed_experts_ref"], chat["prompt_token_ids"],
        c["token_ids"],
    )  # fmt: skip
    ids = choice["prompt_token_ids"]
    tito = _post(
        server,
        "/inference/v1/generate",
        {
            "token_ids": ids,
            "sampling_params": {
                "max_tokens": 8,
                "temperature": 0.0,
                "ignore_eos": True,
                "routed_experts_prompt_start": 20,
            },
        },
    )
    (t,) = tito["choices"]
    _assert_ref_exact(
        consumer, tiny_moe, t["routed_experts_ref"], ids, t["token_ids"], 20
    )


def test_a_request_can_ask_for_inline_routes(server, tiny_moe):
    from vllm.utils.routed_experts_codec import decode_routed_experts

    body = _completion(server, PROMPTS[1], routed_experts_format="inline")
    (choice,) = body["choices"]
    assert choice["routed_experts_ref"] is None
    np.testing.assert_array_equal(
        decode_routed_experts(choice["routed_experts"]),
        expected_r3(tiny_moe, choice["prompt_token_ids"], choice["token_ids"]),
    )
    status, out = http_post(
        server.base_url,
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "routed_experts_format": "npy"},
    )
    assert status == 400, out


def test_streams_carry_the_reference_on_each_final_chunk(server, consumer, tiny_moe):
    import httpx

    body = {
        "model": "tiny",
        "prompt": PROMPTS[2],
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 3,
        "n": 2,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    tokens: dict[int, list[int]] = {}
    refs: dict[int, dict] = {}
    prompt_ids: dict[int, list[int]] = {}
    with httpx.stream(
        "POST", server.base_url + "/v1/completions", json=body, timeout=120
    ) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[len("data: ") :])["choices"]:
                i = ch["index"]
                if ch.get("prompt_token_ids"):
                    prompt_ids[i] = ch["prompt_token_ids"]
                tokens.setdefault(i, []).extend(ch.get("token_ids") or [])
                if ch.get("finish_reason") is None:
                    assert not ch.get("routed_experts_ref"), ch
                else:
                    assert i not in refs
                    refs[i] = ch["routed_experts_ref"]
    assert sorted(refs) == [0, 1] and tokens[0] != tokens[1]
    for i in (0, 1):
        _assert_ref_exact(consumer, tiny_moe, refs[i], prompt_ids[i], tokens[i])


def test_stop_string_cuts_the_referenced_rows(server, consumer, tiny_moe):
    free = _completion(
        server, PROMPTS[4], max_tokens=24, routed_experts_format="inline"
    )
    text = free["choices"][0]["text"]
    stop = text[len(text) // 3 : len(text) // 3 + 4]
    assert stop.strip()
    (choice,) = _completion(server, PROMPTS[4], max_tokens=24, stop=[stop])["choices"]
    assert choice["finish_reason"] == "stop"
    assert len(choice["token_ids"]) < len(free["choices"][0]["token_ids"])
    _assert_ref_exact(
        consumer,
        tiny_moe,
        choice["routed_experts_ref"],
        choice["prompt_token_ids"],
        choice["token_ids"],
    )


def test_abort_with_tokens_returns_a_reference_of_those(server, consumer, tiny_moe):
    result: dict = {}
    t = threading.Thread(
        target=lambda: result.update(
            out=_completion(server, PROMPTS[3], max_tokens=600)
        )
    )
    t.start()
    deadline = time.monotonic() + 60
    while not _generated(server):
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.01)
    _post(server, "/abort_requests", {})
    t.join(timeout=120)
    (choice,) = result["out"]["choices"]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 600
    _assert_ref_exact(
        consumer,
        tiny_moe,
        choice["routed_experts_ref"],
        choice["prompt_token_ids"],
        choice["token_ids"],
    )


def _generated(server, _seen: dict = {}) -> bool:  # noqa: B006
    """Whether the engine generated 4 more tokens since the last call that
    returned True (a request is decoding)."""
    import urllib.request

    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    total = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total")
    )
    base = _seen.setdefault("base", total)
    if total >= base + 4:
        _seen.pop("base")
        return True
    return False


def test_a_reference_is_read_until_released_and_expires_unread(
    server, consumer, tiny_moe
):
    from vllm_host_transport.routes_reader import release

    _host_only(server)
    a = _completion(server, PROMPTS[0])["choices"][0]
    # Read-many: every rank of a step reads it (both reads before the
    # oracle, which loads the model: the server's TTL is 3 s).
    first = consumer.fetch(a["routed_experts_ref"])
    second = consumer.fetch(a["routed_experts_ref"])
    assert isinstance(first, np.ndarray) and isinstance(second, np.ndarray)
    np.testing.assert_array_equal(
        first, expected_r3(tiny_moe, a["prompt_token_ids"], a["token_ids"])
    )
    np.testing.assert_array_equal(second, first)
    # The driver's release (a fresh one: a's TTL may have passed already).
    c = _completion(server, PROMPTS[2])["choices"][0]["routed_experts_ref"]
    assert release([c]) == 1
    assert consumer.fetch(c) == "RouteRefMissingError"
    b = _completion(server, PROMPTS[1])["choices"][0]
    # b is never read in time: the engine removes it after its TTL (the
    # hand-off thread's upkeep runs every second while idle).
    time.sleep(TTL_S + 2.5)
    assert consumer.fetch(b["routed_experts_ref"]) == "RouteRefMissingError"
    # /metrics counts it (updated with the next step).
    _completion(server, PROMPTS[0], max_tokens=2, routed_experts_format="inline")
    assert _metric(server, "vllm:routed_experts_refs_expired_total") >= 1
    assert _metric(server, "vllm:routed_experts_refs_published_total") >= 3
    assert _metric(server, "vllm:routed_experts_refs_waiting_bytes") >= 0


def _metric(server, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    assert values, f"{name} is not on /metrics"
    return sum(values)


def test_a_corrupted_payload_is_a_typed_error(server, consumer, scope, tiny_moe):
    _host_only(server)
    c = _completion(server, PROMPTS[5])["choices"][0]
    want = expected_r3(tiny_moe, c["prompt_token_ids"], c["token_ids"])
    # Stored layer-major: flip a byte of layer 1's rows in the object's file.
    want = np.ascontiguousarray(want[:, 1]).astype(np.uint8).tobytes()
    from vllm_host_transport.readmany import readable_name

    path = os.path.join(
        "/dev/shm", _scope_name(scope), readable_name(c["routed_experts_ref"]["key"])
    )
    with open(path, "r+b") as f:
        data = f.read()
        at = data.rfind(want)
        assert at >= 0, "the routes were not found in their object"
        f.seek(at + len(want) // 2)
        f.write(bytes([data[at + len(want) // 2] ^ 0xFF]))
    assert consumer.fetch(c["routed_experts_ref"]) == "RouteRefCorruptError"
    # A malformed reference is refused before anything is read.
    bad = dict(c["routed_experts_ref"], key="../" + "0" * 29)
    assert consumer.fetch(bad) == "RouteRefInvalidError"
    # The server keeps serving references.
    d = _completion(server, PROMPTS[2], max_tokens=5)["choices"][0]
    _assert_ref_exact(
        consumer, tiny_moe, d["routed_experts_ref"], d["prompt_token_ids"],
        d["token_ids"],
    )  # fmt: skip


# --------------------------------------------------------------- offline
def test_offline_references_bounded_in_bytes(tiny_moe, consumer):
    """``LLM.generate`` with a per-request reference; the unfetched routes
    are bounded by ``ref_max_bytes`` (the oldest go first) and removed at
    shutdown."""
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    scope = f"r3ref-{uuid.uuid4().hex[:12]}"
    # Each response is 30 prompt + 8 new tokens: 37 rows of [2, 2] uint8,
    # 148 bytes, stored after a 64-byte header; 450 bytes hold two of them.
    kwargs = engine_kwargs(tiny_moe)
    kwargs["artifact_config"].update(ref_scope=scope, ref_max_bytes=450)
    llm = LLM(**kwargs)
    try:
        outs = [
            llm.generate(
                [TokensPrompt(prompt_token_ids=list(range(s, s + 30)))],
                greedy(8, routed_experts_format="ref"),
                use_tqdm=False,
            )[0]
            for s in (10, 50, 90)
        ]
        inline = llm.generate([PROMPTS[0]], greedy(8), use_tqdm=False)[0]
        assert inline.outputs[0].routed_experts_ref is None
        np.testing.assert_array_equal(
            inline.outputs[0].routed_experts,
            expected_r3(tiny_moe, inline.prompt_token_ids, inline.outputs[0].token_ids),
        )
        refs = [o.outputs[0].routed_experts_ref for o in outs]
        assert all(o.outputs[0].routed_experts is None for o in outs)
        assert [r.nbytes for r in refs] == [148] * 3
        assert [r.header_nbytes for r in refs] == [64] * 3
        # The third put pushed the first one out.
        assert consumer.fetch(refs[0].to_json()) == "RouteRefMissingError"
        for o, ref in zip(outs[1:], refs[1:]):
            _assert_ref_exact(
                consumer, tiny_moe, ref.to_json(), o.prompt_token_ids,
                o.outputs[0].token_ids,
            )  # fmt: skip
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=30)
        del llm
    # The engine's objects are gone (the scope with them: no reader holds it).
    _assert_no_payloads_left(scope)


# ------------------------------------------- squatted, stopped, killed
NOBODY = 65534


def _three_refs(llm):
    from vllm.inputs import TokensPrompt

    outs = [
        llm.generate(
            [TokensPrompt(prompt_token_ids=list(range(s, s + 30)))],
            greedy(8, routed_experts_format="ref"),
            use_tqdm=False,
        )[0]
        for s in (10, 50, 90)
    ]
    return outs, [o.outputs[0].routed_experts_ref for o in outs]


def test_a_squatted_scope_then_a_clean_close_while_a_trainer_holds_it(
    tiny_moe, tmp_path
):
    """Another user created the scope's directory first: the engine hands
    references out in a fresh private scope that they name, and they fetch
    exactly. A trainer holds nothing in the scope (it reads objects, it
    does not join): the engine's close removes its payloads and the
    scope."""
    from vllm import LLM

    scope = f"r3ref-{uuid.uuid4().hex[:12]}"
    squat = os.path.join("/dev/shm", _scope_name(scope))
    os.mkdir(squat, 0o700)
    trainer = None
    try:
        try:
            os.chown(squat, NOBODY, NOBODY)
        except PermissionError:
            pytest.skip("making a directory of another user needs root")
        trainer = Consumer(tmp_path)
        kwargs = engine_kwargs(tiny_moe)
        kwargs["artifact_config"].update(ref_scope=scope)
        llm = LLM(**kwargs)
        try:
            outs, refs = _three_refs(llm)
            location = refs[0].location
            assert location.startswith(scope + "~")
            assert {r.location for r in refs} == {location}
            _assert_ref_exact(
                trainer, tiny_moe, refs[0].to_json(), outs[0].prompt_token_ids,
                outs[0].outputs[0].token_ids,
            )  # fmt: skip
            fallback = os.path.join("/dev/shm", _scope_name(location))
            assert stat.S_IMODE(os.stat(fallback).st_mode) == 0o700
            assert _payload_files(fallback)  # the two others wait there
        finally:
            llm.llm_engine.engine_core.shutdown(timeout=30)
            del llm
        # Stopped: nothing of the engine's is left, nor its scope.
        assert not os.path.exists(fallback)
        for ref in refs[1:]:
            assert trainer.fetch(ref.to_json()) == "RouteRefMissingError"
    finally:
        if trainer is not None:
            trainer.close()
        os.rmdir(squat)
    assert not os.path.exists(fallback)


def _exitcode(proc, timeout_s: float) -> int | None:
    """``proc``'s exit code once it has ended. vLLM's engine monitor reads
    ``proc.exitcode`` on its own thread too: when its ``waitpid`` reaps the
    process first, this thread's finds no child and sees None until the
    monitor has stored the code, so wait for it rather than read once."""
    deadline = time.monotonic() + timeout_s
    proc.join(timeout_s)
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.exitcode


def test_a_killed_engine_core_then_a_trainer_reads(tiny_moe, tmp_path):
    """The engine core is SIGKILLed with references waiting: a trainer's
    next read of one of them finds its producer dead, answers
    ``RouteRefMissingError`` at once, and removes what the killed engine
    left (the scope no live connector holds)."""
    from vllm import LLM

    scope = f"r3ref-{uuid.uuid4().hex[:12]}"
    path = os.path.join("/dev/shm", _scope_name(scope))
    trainer = Consumer(tmp_path)
    kwargs = engine_kwargs(tiny_moe)
    kwargs["artifact_config"].update(ref_scope=scope)
    root = kwargs["artifact_config"]["shm_root"]
    try:
        llm = LLM(**kwargs)
        try:
            outs, refs = _three_refs(llm)
            _assert_ref_exact(
                trainer, tiny_moe, refs[0].to_json(), outs[0].prompt_token_ids,
                outs[0].outputs[0].token_ids,
            )  # fmt: skip
            assert _payload_files(path)
            (core,) = llm.llm_engine.engine_core.resources.engine_manager.processes
            os.kill(core.pid, signal.SIGKILL)
            assert _exitcode(core, 30) == -signal.SIGKILL
            assert _payload_files(path)  # nobody removed them yet
            t0 = time.monotonic()
            assert trainer.fetch(refs[1].to_json()) == "RouteRefMissingError"
            took = time.monotonic() - t0
            assert _payload_files(path) == []
            assert took < 0.5, took  # a missing reference answers at once
            assert trainer.fetch(refs[2].to_json()) == "RouteRefMissingError"
        finally:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown(timeout=30)
            del llm
    finally:
        trainer.close()
        # The killed engine's artifact store (its writer died with it).
        shutil.rmtree(root, ignore_errors=True)
    assert not os.path.exists(path)


def test_a_restarted_engine_sweeps_a_killed_ones_payloads_at_start(tiny_moe):
    """A killed engine's references (its objects and registration; here a
    producer process of the same scope, SIGKILLed so nothing of it
    runs at exit) stay in the scope while no other process looks. A new
    engine on the same scope removes them as it starts, before any request
    asks for a reference."""
    import subprocess
    import sys
    from pathlib import Path

    from vllm import LLM

    scope = f"r3ref-{uuid.uuid4().hex[:12]}"
    path = os.path.join("/dev/shm", _scope_name(scope))
    repo = Path(__file__).resolve().parent.parent
    killed = subprocess.Popen(
        [sys.executable, "-m", "tests.host_transport.pidns_peer", "produce", scope],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert killed.stdout is not None
        json.loads(killed.stdout.readline())  # its payloads are in place
    finally:
        killed.kill()
        killed.wait(30)
    left = _payload_files(path)
    assert len([n for n in left if n.endswith(".rdm")]) == 3, left
    kwargs = engine_kwargs(tiny_moe)
    kwargs["artifact_config"].update(ref_scope=scope)
    try:
        llm = LLM(**kwargs)
        try:
            # Started, and no request yet: the killed producer's objects
            # and registration go (the hand-off thread joins the
            # scope as the engine starts, maybe just after LLM() returns).
            deadline = time.monotonic() + 60
            while _payload_files(path) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _payload_files(path) == []
        finally:
            llm.llm_engine.engine_core.shutdown(timeout=30)
            del llm
        assert not os.path.exists(path)  # the engine left the scope last
    finally:
        shutil.rmtree(path, ignore_errors=True)  # a failure's leftovers


def _fetch_in_another_pid_namespace(refs: list[dict]) -> list[dict]:
    """Fetch ``refs`` from a process in a new PID namespace (a trainer in
    another container sharing ``/dev/shm``): one result per reference."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    argv = [
        "unshare", "--pid", "--fork", "--mount-proc",
        sys.executable, "-m", "tests.host_transport.pidns_peer", "fetch",
        json.dumps(refs),
    ]  # fmt: skip
    r = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_a_trainer_in_another_pid_namespace_fetches_and_removes_nothing_else(
    tiny_moe, consumer
):
    """r5 H1 from outside: under ``vllm serve``, a consumer in another PID
    namespace fetches its references, and every other reference still
    fetches, exact, from the server's own namespace afterwards."""
    r = __import__("subprocess").run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True
    )
    if os.geteuid() != 0 or r.returncode:
        pytest.skip("a new PID namespace needs root and unshare(1)")
    scope = f"r3ref-pidns-{uuid.uuid4().hex[:12]}"
    root = shm_root()
    flags = serve_flags(root, routed_experts_format="ref", ref_scope=scope)
    with r3_server(tiny_moe, flags, root, "test-r3-ref-pidns.log") as srv:
        prompts = [p + tail for tail in ("", " Once more.") for p in PROMPTS[:4]]
        choices = [_completion(srv, p)["choices"][0] for p in prompts]
        refs = [c["routed_experts_ref"] for c in choices]
        foreign = _fetch_in_another_pid_namespace(refs[:2])
        assert [f["error"] for f in foreign] == ["", ""]
        for f, c in zip(foreign, choices[:2]):
            want = expected_r3(tiny_moe, c["prompt_token_ids"], c["token_ids"])
            want = np.ascontiguousarray(want, dtype=np.uint8)
            assert f["sha256"] == hashlib.sha256(want.tobytes()).hexdigest()
        for c in choices[2:]:
            _assert_ref_exact(
                consumer, tiny_moe, c["routed_experts_ref"], c["prompt_token_ids"],
                c["token_ids"],
            )  # fmt: skip
    _assert_no_payloads_left(scope)
