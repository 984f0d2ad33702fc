# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared pieces of the R3 engine tests: the store root, engine arguments and
the row-by-row comparison with transformers' router."""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.request
import uuid

import numpy as np

from utils.oracle import expected_r3

BLOCK_SIZE = 32
SHARED_PREFIX = (
    "Reinforcement learning needs the same routes in training and inference. "
    "A router picks the top k experts for each token in each layer. "
    "The prefix cache reuses key and value blocks across requests. "
    "Every block of thirty two tokens gets a hash that chains to its parent. "
    "Shared memory lets two processes on one node exchange bytes quickly. "
)
PROMPTS = [
    "Hello, how are you today?",
    "Mixture of experts models route every token to a few experts.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text.",
    "def add(a, b): return a + b",
    "Write a short poem about the sea and the sky.",
    "Once",
]


def pool_prompts(tag: str) -> list[str]:
    """Two prompts of their own for the shared-KV tests (``tag`` first, so
    no block is shared with another test's), each ending in a partial
    block."""
    return [
        f"{tag}: {SHARED_PREFIX}",
        f"{tag}: Mixture of experts models route every token to a few experts, "
        "and the routes of one engine must match those of another one.",
    ]


def loaded_tokens(out) -> int:
    """Tokens of ``out`` whose KV came from the cache (a KV pool's too)."""
    return out.num_cached_tokens


def from_storage(out) -> int:
    """What ExampleConnector loads of ``out``'s prompt: the full blocks
    before its last token (the engine computes the rest)."""
    n = len(out.prompt_token_ids)
    assert n % BLOCK_SIZE, f"{n} prompt tokens: no partial last block"
    return (n - 1) // BLOCK_SIZE * BLOCK_SIZE


def shm_root() -> str:
    """A store root for one engine; the conftest leak guard attributes it to
    this test session (the pid is in its name) and the writer removes it on
    a clean shutdown."""
    return f"/dev/shm/vart-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def engine_kwargs(model, **overrides) -> dict:
    kwargs = dict(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        enable_routed_experts=True,
        max_model_len=1024,
        max_num_seqs=8,
        seed=0,
        artifact_config={"shm_root": shm_root()},
    )
    kwargs.update(overrides)
    return kwargs


def greedy(max_tokens: int = 10, **kw):
    from vllm import SamplingParams

    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def assert_exact(model, prompt_ids, completion, dtype=np.uint8, first_row=0):
    """``completion.routed_experts`` equals transformers' router for every
    executed token (prompt + completion minus the last sampled token), from
    ``first_row`` on; returns the full oracle array."""
    got = completion.routed_experts
    assert got is not None, (
        f"no routed_experts (finish {completion.finish_reason}, "
        f"error {completion.routed_experts_error})"
    )
    assert completion.routed_experts_error is None
    want = expected_r3(model, prompt_ids, completion.token_ids)
    assert got.dtype == dtype, got.dtype
    want_part = want[first_row:]
    assert got.shape == want_part.shape, (got.shape, want_part.shape)
    bad = np.argwhere(got != want_part)
    assert bad.size == 0, (
        f"{len(bad)} routes differ from transformers' router, first at "
        f"[row, layer, k] = {(bad[0] + [first_row, 0, 0]).tolist()}"
    )
    return want


@contextlib.contextmanager
def pickled_rpc():
    """The tests read the publishing worker's counters with
    ``collective_rpc(fn)``, which pickles ``fn`` and its result: allowed only
    while the R3 engine tests run (their engines inherit it), so that no other
    test sees the setting."""
    name = "VLLM_ALLOW_INSECURE_SERIALIZATION"
    old = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def worker_stats(llm) -> dict:
    """The publishing worker's connector counters (first rank)."""

    def stats(worker):
        return worker.model_runner.artifact_connector.stats()

    return llm.collective_rpc(stats)[0]


def assert_nothing_retained(llm, timeout_s: float = 10.0) -> None:
    """Once the engine is idle, no request retains store objects and no row
    page is in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = worker_stats(llm)
        if s["retainers"] == 0 and s["slab_pages_used"] == 0 and not s["attempts"]:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"retained after the requests finished: {s}")
        time.sleep(0.1)


# ----------------------------------------------------------------- HTTP
def serve_flags(root: str, **artifact) -> list[str]:
    """``vllm serve`` flags of the R3 HTTP tests: the tiny MoE in float32,
    token-in/token-out, the store under ``root`` (plus ``artifact``'s
    settings), and a draining shutdown (every process removes its own
    files instead of being killed at once)."""
    return [
        "--served-model-name", "tiny", "--enable-routed-experts",
        "--enable-scale-out", "--dtype", "float32",
        "--block-size", str(BLOCK_SIZE), "--max-model-len", "1024",
        "--max-num-seqs", "8", "--enforce-eager", "--enable-prompt-tokens-details",
        "--artifact-config", json.dumps({"shm_root": root, **artifact}),
        "--shutdown-timeout", "30",
    ]  # fmt: skip


@contextlib.contextmanager
def r3_server(model, flags: list[str], root: str, log_name: str):
    """A ``vllm serve`` with the R3 test flags and the development endpoints
    (``/pause``, ``/resume``, ``/reset_prefix_cache``); ``srv.shm_root`` is
    ``root``, which must be gone after the clean shutdown."""
    from server import VllmServer

    old = os.environ.get("VLLM_SERVER_DEV_MODE")
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    try:
        with VllmServer(model, flags, log_name=log_name) as srv:
            srv.shm_root = root
            yield srv
    finally:
        if old is None:
            os.environ.pop("VLLM_SERVER_DEV_MODE", None)
        else:
            os.environ["VLLM_SERVER_DEV_MODE"] = old
    assert not os.path.exists(root), "the store outlived a clean shutdown"


@contextlib.contextmanager
def ref_server(model, transport: str, name: str, **artifact):
    """:func:`r3_server` serving routes by reference over ``transport``
    (``host``, or ``mooncake`` behind a real master of its own, skipped with
    the reason when Mooncake's client is missing); ``srv.transport`` says
    which. ``artifact``: more ``--artifact-config`` settings."""
    import pytest

    root = shm_root()
    artifact = dict(routed_experts_format="ref", **artifact)
    with contextlib.ExitStack() as stack:
        if transport == "mooncake":
            pytest.importorskip(
                "mooncake.store",
                reason="Mooncake's client is installed by `make setup`",
            )
            from utils.mooncake import running_master

            master = stack.enter_context(running_master(f"mooncake-master-{name}"))
            artifact.update(
                ref_transport="mooncake",
                mooncake_master=master.address,
                mooncake_segment_bytes=64 << 20,
                mooncake_buffer_bytes=32 << 20,
            )
        flags = serve_flags(root, **artifact)
        with r3_server(model, flags, root, f"test-r3-{name}-{transport}.log") as srv:
            srv.transport = transport
            yield srv


def http_post(
    base_url: str, path: str, body: dict | None = None, timeout: float = 120
) -> tuple[int, dict]:
    """POST JSON; returns (status, parsed body), for errors too."""
    req = urllib.request.Request(
        base_url + path,
        data=json.dumps(body or {}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def assert_completion_exact(model, body: dict, first_row: int = 0) -> np.ndarray:
    """A ``/v1/completions`` JSON answer (sent with ``return_token_ids``)
    carries routes equal to transformers' router; returns them."""
    from vllm.utils.routed_experts_codec import decode_routed_experts

    (choice,) = body["choices"]
    assert choice.get("routed_experts") is not None, choice
    got = decode_routed_experts(choice["routed_experts"])
    want = expected_r3(model, choice["prompt_token_ids"], choice["token_ids"])
    np.testing.assert_array_equal(got, want[first_row:])
    return got


# ----------------------------------------------------------------- the store
def store_objects(root: str) -> list[tuple[str, tuple[int, int]]]:
    """The live objects (every version) of the one store under ``root``:
    ``(key, (arena id, offset))``, read through a reader of our own."""
    from vllm.distributed.artifact_connector.shm import ShmStoreReader

    (ns,) = os.listdir(root)
    reader = ShmStoreReader(root, ns)
    try:
        idx = reader._index
        slots = idx.live_slots()
        places = zip(idx.arena[slots].tolist(), idx.off[slots].tolist())
        return list(zip(idx.keys_of(slots), places))
    finally:
        reader.close()


def corrupt_objects(root: str, places) -> None:
    """Flip the first byte of each object behind the store's back."""
    (ns,) = os.listdir(root)
    for aid, off in places:
        fd = os.open(
            os.path.join(root, ns, f"{aid:016x}.arena"), os.O_RDWR | os.O_NOFOLLOW
        )
        try:
            os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0xFF]), off)
        finally:
            os.close(fd)
