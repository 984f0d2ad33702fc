# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routes on KV another engine computed (``backend: mooncake``): two real
engines on this machine share KV through vLLM's ``ExampleConnector``
(safetensors files in one directory) and routes through a real
``mooncake_master`` on 127.0.0.1 (TCP). A prompt one engine computed is
loaded from storage by the other, whose routes for the loaded blocks come
from the shared key space and for the rest (the partial last block, the
completion) from its own forward; every array is checked against
transformers' router in float32. Both ways KV moves between engines here:
a pool both engines read and write (``kv_both``), and a prefill/decode
pair (``kv_producer`` -> ``kv_consumer``), the decode engine also as
``vllm serve`` with idle gaps of 6 s between requests. Faults: the prefill engine
restarted (the routes its segment held go with it; the decode engine takes
the blocks whose routes survived and recomputes the rest), the shared routes
removed behind the engines, the master stopped (the KV is recomputed
instead of loaded, routes exact) and restarted (loaded again), the master
frozen (both engines serve on, exactly, without waiting for it), and an
engine that hashes blocks differently refused at startup."""

from __future__ import annotations

import contextlib
import json
import os
import time

import numpy as np
import pytest
from utils.mooncake import running_master
from utils.r3 import (
    assert_completion_exact,
    assert_exact,
    engine_kwargs,
    from_storage,
    greedy,
    http_post,
    loaded_tokens,
    pool_prompts,
    r3_server,
    serve_flags,
    shm_root,
    store_objects,
)

pytestmark = pytest.mark.engine

mooncake = pytest.importorskip(
    "mooncake.store", reason="Mooncake's client is installed by `make setup`"
)

KEY_SPACE = "test-shared-kv"
BLOCK = 32
P = "vllm:routed_experts_"


# The key space's deployment secret: one 0600 file every engine is given.
SECRET_FILE: list[str] = []


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    secret = tmp_path_factory.mktemp("key-space") / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    SECRET_FILE[:] = [str(secret)]
    with running_master("mooncake-master-shared-kv") as m:
        yield m


def _kv_transfer(storage, role: str) -> dict:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }


def _shared_tier(master) -> dict:
    return dict(
        backend="mooncake",
        key_space=KEY_SPACE,
        mooncake_master=master.address,
        mooncake_segment_bytes=64 << 20,
        mooncake_buffer_bytes=16 << 20,
        shared_secret_file=SECRET_FILE[0],
    )


def _engine(model, master, storage, role: str, **overrides):
    from vllm import LLM

    kwargs = engine_kwargs(
        model,
        disable_log_stats=False,
        kv_transfer_config=_kv_transfer(storage, role),
        **overrides,
    )
    kwargs["artifact_config"].update(_shared_tier(master))
    return LLM(**kwargs)


def _close(*engines) -> None:
    for e in engines:
        e.llm_engine.engine_core.shutdown(timeout=30)


@pytest.fixture(scope="module")
def pool(tiny_moe, master, tmp_path_factory):
    """Two engines reading and writing one KV pool (kv_both)."""
    storage = tmp_path_factory.mktemp("kv-pool")
    a = _engine(tiny_moe, master, storage, "kv_both")
    b = _engine(tiny_moe, master, storage, "kv_both")
    yield a, b
    _close(a, b)


def _counter(llm, name: str) -> float:
    return sum(
        m.value for m in llm.get_metrics() if m.name == P + name and hasattr(m, "value")
    )


def test_prefill_decode_pair(tiny_moe, master, tmp_path):
    """A prefill engine (kv_producer) computes the prompt and one token; the
    decode engine (kv_consumer) loads its KV and returns the routes of every
    token it executed: the prefill engine's for the loaded blocks. Then the
    prefill engine is restarted (its Mooncake client and segment go, and a
    new one joins the key space): whatever the old one's segment held, the
    decode engine's routes stay exact, and the new one's are shared."""
    prefill = _engine(tiny_moe, master, tmp_path, "kv_producer")
    decode = _engine(tiny_moe, master, tmp_path, "kv_consumer")
    try:
        prompts = pool_prompts("pd")
        for out in prefill.generate(prompts, greedy(1), use_tqdm=False):
            assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
        outs = decode.generate(prompts, greedy(12), use_tqdm=False)
        for out in outs:
            assert loaded_tokens(out) == from_storage(out) > 0
            assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
        (late,) = pool_prompts("pd-late")[:1]
        prefill.generate([late], greedy(1), use_tqdm=False)
        _close(prefill)
        prefill = _engine(tiny_moe, master, tmp_path, "kv_producer")
        # Routes the old engine's segment held are gone, those in another
        # segment are not: the hit is taken up to the first block without
        # routes (any whole number of blocks), the rest recomputed, and the
        # routes are exact either way.
        (out,) = decode.generate([late], greedy(4), use_tqdm=False)
        assert loaded_tokens(out) % BLOCK == 0
        assert 0 <= loaded_tokens(out) <= from_storage(out)
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
        (fresh,) = pool_prompts("pd-restarted")[:1]
        prefill.generate([fresh], greedy(1), use_tqdm=False)
        (out,) = decode.generate([fresh], greedy(4), use_tqdm=False)
        assert loaded_tokens(out) == from_storage(out) > 0
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
    finally:
        _close(prefill, decode)


SERVE_PROMPTS = 20
IDLE_GAP_S = 6.0  # Mooncake issue 4209: the first transfer after ~5 s idle


def test_decode_engine_over_http(tiny_moe, master, tmp_path):
    """The decode engine as ``vllm serve`` (kv_consumer, its flags as a user
    passes them) behind a prefill engine, with idle gaps longer than 5 s
    between requests (the trigger of Mooncake issue 4209 on 0.3.13.post1,
    which can leave a connection dead until Mooncake drops it at 30 s):
    every OpenAI completion returns the routes of the whole request, exact.
    The routes of the loaded blocks are pulled before the hit is taken; a
    pull the dead connection holds past shared_pull_timeout_s costs that
    prompt the recomputation of its hit, never its answer. Its usage counts
    the blocks it loaded as cached, whole blocks, and some prompts load
    their whole hit (the pair does share KV)."""
    prefill = _engine(
        tiny_moe, master, tmp_path, "kv_producer", served_model_name="tiny"
    )
    root = shm_root()
    flags = serve_flags(root, **_shared_tier(master))
    flags += ["--kv-transfer-config", json.dumps(_kv_transfer(tmp_path, "kv_consumer"))]
    loaded = []
    try:
        with r3_server(tiny_moe, flags, root, "test-r3-shared-kv-serve.log") as srv:
            for i in range(SERVE_PROMPTS):
                time.sleep(IDLE_GAP_S)
                prompt = pool_prompts(f"pd-http-{i}")[i % 2]
                (done,) = prefill.generate([prompt], greedy(1), use_tqdm=False)
                time.sleep(IDLE_GAP_S)
                status, body = http_post(srv.base_url, "/v1/completions", {
                    "model": "tiny", "prompt": prompt, "max_tokens": 4,
                    "temperature": 0.0, "return_token_ids": True,
                    "ignore_eos": True,
                })  # fmt: skip
                assert status == 200, (i, status, body)
                assert body["choices"][0]["prompt_token_ids"] == done.prompt_token_ids
                cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached % BLOCK == 0 and cached <= from_storage(done)
                assert_completion_exact(tiny_moe, body)
                loaded.append(cached == from_storage(done))
    finally:
        _close(prefill)
        print(
            f"decode engine over HTTP: {len(loaded)} of {SERVE_PROMPTS} exact, "
            f"{sum(loaded)} loaded whole, recomputed: "
            f"{[i for i, whole in enumerate(loaded) if not whole]}"
        )
    assert any(loaded), "no prompt loaded the prefill engine's KV"


def test_pool_hit_on_kv_the_other_engine_computed(pool, tiny_moe):
    a, b = pool
    prompts = pool_prompts("pool")
    pulled = _counter(b, "store_shared_pulled_objects")
    for out in a.generate(prompts, greedy(2), use_tqdm=False):
        assert loaded_tokens(out) == 0
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
    outs = b.generate(prompts, greedy(8), use_tqdm=False)
    for out in outs:
        assert loaded_tokens(out) == from_storage(out) > 0
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
    # The worker sends its counters with a step at most once a second.
    time.sleep(1.5)
    b.generate(["Once"], greedy(1), use_tqdm=False)
    blocks = sum(loaded_tokens(o) for o in outs) // BLOCK
    assert _counter(b, "store_shared_pulled_objects") == pulled + blocks


def test_kv_whose_routes_are_gone_is_recomputed(pool, tiny_moe):
    """Objects Mooncake no longer has (evicted under pressure, or lost with
    the segment that held them), while the pool still has the KV: the
    scheduler takes the pool's hit only as far as routes exist, so the
    engine recomputes the blocks and returns exact routes, instead of
    failing this request and every later one on the prefix."""
    from mooncake.store import MooncakeDistributedStore

    a, b = pool
    (prompt, _) = pool_prompts("removed")
    (first,) = a.generate([prompt], greedy(2), use_tqdm=False)
    assert_exact(tiny_moe, first.prompt_token_ids, first.outputs[0])
    time.sleep(1.0)  # a's publication thread has mirrored the blocks
    master_address = a.llm_engine.vllm_config.artifact_config.mooncake_master
    client = MooncakeDistributedStore()
    assert (
        client.setup(
            "127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master_address
        )
        == 0
    )
    try:
        assert client.remove_by_regex("^vllm-artifact/", True) > 0
    finally:
        client.close()
    (out,) = b.generate([prompt], greedy(4), use_tqdm=False)
    assert loaded_tokens(out) == 0
    assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
    # A recomputation publishes the blocks' routes again, so the pool's hit
    # is taken again. Shown across a prefix-cache reset of both engines (a
    # reset moves every engine of the key space to keys of a new cache
    # epoch together; resetting one alone would split them): a's hit on the
    # pool's KV finds no routes of the new epoch and is recomputed, and b's
    # then loads the pool's KV with a's new routes.
    time.sleep(1.0)
    assert a.reset_prefix_cache() and b.reset_prefix_cache()
    (out,) = a.generate([prompt], greedy(4), use_tqdm=False)
    assert loaded_tokens(out) == 0
    assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
    time.sleep(1.0)  # a's publication thread has mirrored the blocks
    (out,) = b.generate([prompt], greedy(4), use_tqdm=False)
    assert loaded_tokens(out) == from_storage(out) > 0
    assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])


@contextlib.contextmanager
def _tier(llm):
    """The shared tier as an engine of the key space sees it (the test's
    own client, given the key space's secret): MooncakeObjects."""
    from vllm.config.artifact_transfer import shared_secret
    from vllm.distributed.artifact_connector.mooncake import client as mc
    from vllm.distributed.artifact_connector.mooncake.key_space import (
        max_object_nbytes,
    )
    from vllm.distributed.artifact_connector.mooncake.objects import (
        MooncakeObjects,
    )

    cfg = llm.llm_engine.vllm_config.artifact_config
    client = mc.acquire(cfg, segment_bytes=0)
    shared = MooncakeObjects(
        client,
        str(cfg.mooncake_master),
        secret=shared_secret(cfg),
        max_object_nbytes=max_object_nbytes(llm.llm_engine.vllm_config),
    )
    try:
        yield shared
    finally:
        shared.close()
        mc.release(client)


def _full_blocks(llm, shared, prompt: str, model) -> list[tuple[str, np.ndarray]]:
    """Compute ``prompt`` on ``llm`` (two tokens), wait for its mirror, and
    return its full blocks' objects in the tier in prompt order: (key, the
    object's bytes)."""
    from vllm.distributed.artifact_connector.request_core import (
        ENVELOPE_DTYPE,
        ENVELOPE_NBYTES,
    )

    root = llm.llm_engine.vllm_config.artifact_config.shm_root
    before = {k for k, _ in store_objects(root)}
    (out,) = llm.generate([prompt], greedy(2), use_tqdm=False)
    assert_exact(model, out.prompt_token_ids, out.outputs[0])
    time.sleep(1.0)  # the publication thread has mirrored the blocks
    keys = sorted({k for k, _ in store_objects(root)} - before)
    refs, data, rejected = shared.fetch(keys)
    assert rejected == [] and len(refs) == len(keys)
    blocks = []
    o = 0
    for ref in refs:
        obj = data[o : o + ref.nbytes]
        o += ref.nbytes
        env = obj[-ENVELOPE_NBYTES:].copy().view(ENVELOPE_DTYPE)[0]
        if int(env["rows"]) == BLOCK:
            blocks.append((int(env["start"]), ref.key, obj.copy()))
    blocks.sort()
    assert len(blocks) == from_storage(out) // BLOCK > 1
    return [(k, obj) for _, k, obj in blocks]


def test_a_recompute_elsewhere_leaves_the_routes_of_the_loaded_kv(pool, tiny_moe):
    """Engine a computes a prompt: the KV pool keeps its KV (ExampleConnector
    stores a prompt's KV once, the first time), the tier its routes. Then
    another engine of the key space computes the same blocks again and, a
    near tie going the other way in its batch, gets other routes for every
    block (written here as that engine would: genuine objects under the key
    space's secret). b, loading the pool's KV (a's), gets a's routes: the
    tier keeps a key's first object, as the pool keeps its first KV."""
    from vllm.distributed.artifact_connector.store import ObjectRef, checksum

    a, b = pool
    (prompt, _) = pool_prompts("first-writer")
    with _tier(a) as shared:
        blocks = _full_blocks(a, shared, prompt, tiny_moe)
        keys = [k for k, _ in blocks]
        other = np.concatenate([obj for _, obj in blocks])
        sizes = [len(obj) for _, obj in blocks]
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        other[offsets] = (other[offsets] + 1) % 8  # row 0's first expert of 8
        refs = [
            ObjectRef(k, checksum(other[o : o + n].data), n)
            for k, o, n in zip(keys, offsets.tolist(), sizes)
        ]
        assert shared.put(keys, refs, other, offsets) == 0  # Mooncake took it
        got, data, _ = shared.fetch(keys)
        assert [r.key for r in got] == keys
        assert bytes(data) == b"".join(obj.tobytes() for _, obj in blocks)
    (out,) = b.generate([prompt], greedy(4), use_tqdm=False)
    assert loaded_tokens(out) == from_storage(out) > 0
    assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])


def test_a_corrupt_shared_object_is_removed_and_the_prefix_heals(pool, tiny_moe):
    """One of a prompt's shared objects altered behind the engines (its MAC
    kept, a byte of its routes changed): b's pull refuses it and removes it
    from the tier, takes the hit up to that block and recomputes the rest
    (exact); its recomputation puts a genuine object in its place, so the
    tier serves the whole prefix again, verified, to every engine."""
    from mooncake.store import MooncakeDistributedStore

    from vllm.distributed.artifact_connector.mooncake.objects import HEADER, PREFIX

    a, b = pool
    (prompt, _) = pool_prompts("healed")
    rejected = _counter(b, "store_shared_rejected_objects")
    with _tier(a) as shared:
        blocks = _full_blocks(a, shared, prompt, tiny_moe)
        j = len(blocks) // 2
        k, obj = blocks[j]
        cfg = a.llm_engine.vllm_config.artifact_config
        raw = MooncakeDistributedStore()
        assert raw.setup(
            "127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cfg.mooncake_master
        ) == 0  # fmt: skip
        try:
            whole = np.zeros(HEADER.itemsize + len(obj), np.uint8)
            assert raw.register_buffer(whole.ctypes.data, whole.nbytes) == 0
            ptr, n = whole.ctypes.data, whole.nbytes
            assert raw.batch_get_into([PREFIX + k], [ptr], [n]) == [n]
            whole[HEADER.itemsize] ^= 1  # the header (and its MAC) kept
            assert raw.remove(PREFIX + k, True) == 0
            assert raw.batch_upsert_from([PREFIX + k], [ptr], [n]) == [0]
            raw.unregister_buffer(ptr)
        finally:
            raw.close()
        (out,) = b.generate([prompt], greedy(4), use_tqdm=False)
        assert loaded_tokens(out) == j * BLOCK  # the blocks before the altered one
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
        time.sleep(1.5)  # b's mirror; its counters come with a step, once a second
        b.generate(["Once"], greedy(1), use_tqdm=False)
        assert _counter(b, "store_shared_rejected_objects") == rejected + 1
        keys = [key for key, _ in blocks]
        got, data, bad = shared.fetch(keys)
        assert bad == [] and [r.key for r in got] == keys  # healed
        assert bytes(data) == b"".join(o.tobytes() for _, o in blocks)
    # Every engine's next request on the prefix is exact.
    for llm in (a, b):
        assert llm.reset_prefix_cache()
        (out,) = llm.generate([prompt], greedy(4), use_tqdm=False)
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])


def test_master_stopped_and_restarted(pool, tiny_moe, master):
    a, b = pool
    (before, during, after) = (pool_prompts(t)[0] for t in ("before", "down", "back"))
    (out,) = a.generate([before], greedy(2), use_tqdm=False)
    time.sleep(1.0)
    master.stop()
    try:
        # b cannot reach the routes of a's KV: it recomputes the blocks.
        (out,) = b.generate([before], greedy(4), use_tqdm=False)
        assert loaded_tokens(out) == 0
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
        # a serves its own requests exactly meanwhile (its mirror fails).
        (out,) = a.generate([during], greedy(4), use_tqdm=False)
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
    finally:
        master.start()
    # The restarted master knows nothing; the clients join it again within
    # seconds, and routes computed from then on are shared again.
    restarted = time.monotonic()
    deadline = restarted + 60
    for i in range(1000):
        prompt = f"{i} {after}"
        a.generate([prompt], greedy(1), use_tqdm=False)
        time.sleep(1.0)
        (out,) = b.generate([prompt], greedy(4), use_tqdm=False)
        # While the clients rejoin, some of a's writes may still fail: b
        # then takes part of the hit, or none of it, exact every time.
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
        assert loaded_tokens(out) % BLOCK == 0
        if loaded_tokens(out) == from_storage(out):
            break
        assert time.monotonic() < deadline, "the KV pool's hits never came back"
    print(f"sharing back {time.monotonic() - restarted:.1f} s after the restart")


def _gauge(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == P + name)


def test_master_frozen_both_engines_keep_serving(pool, tiny_moe, master):
    """The master frozen (SIGSTOP: every Mooncake call to it hangs, up to
    Mooncake's own 30 s timeout): both engines keep serving, exactly and
    before it resumes. b recomputes the KV of a's prompt (the tier gives
    no answer in time), a's own prefix hits and new prompts are exact,
    nothing stays retained; after the resume, sharing comes back."""
    import os
    import signal

    a, b = pool
    before, new = (pool_prompts(t)[0] for t in ("frozen-before", "frozen-new"))
    (out,) = a.generate([before], greedy(2), use_tqdm=False)
    time.sleep(1.0)
    os.kill(master.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        (out,) = b.generate([before], greedy(4), use_tqdm=False)
        assert loaded_tokens(out) == 0
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
        for llm in (a, b):  # a local prefix hit each, and new prompts
            outs = llm.generate([before, new], greedy(4), use_tqdm=False)
            assert loaded_tokens(outs[0]) > 0
            for out in outs:
                assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
        (out,) = b.generate([f"b {new}"], greedy(4), use_tqdm=False)
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
        served_s = time.monotonic() - t0
        time.sleep(1.5)  # the workers' counters come with a step, once a second
        for llm in (a, b):
            llm.generate(["Once"], greedy(1), use_tqdm=False)
            assert _gauge(llm, "store_retained_objects") == 0
    finally:
        os.kill(master.proc.pid, signal.SIGCONT)
    # Mooncake would hold each call 30 s: the engines waited for none.
    assert served_s < 15.0, f"{served_s:.1f} s with the master frozen"
    deadline = time.monotonic() + 90
    for i in range(1000):
        prompt = f"{i} thawed {new}"
        a.generate([prompt], greedy(1), use_tqdm=False)
        time.sleep(1.0)
        (out,) = b.generate([prompt], greedy(4), use_tqdm=False)
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
        if loaded_tokens(out) == from_storage(out):
            break
        assert time.monotonic() < deadline, "sharing never came back"


def test_engine_hashing_differently_is_refused(tiny_moe, master, tmp_path, capfd):
    """An engine of the key space whose blocks are 64 tokens, where the
    engines that recorded the key space hash 32-token blocks: its keys could
    never match theirs, so it does not start, and says why."""
    with pytest.raises(RuntimeError):
        _engine(tiny_moe, master, tmp_path, "kv_both", block_size=64)
    err = capfd.readouterr().err
    assert "cannot join the artifact key space 'test-shared-kv'" in err
    assert "block_size: this engine 64, the key space 32" in err
    assert "use the same --block-size on every engine" in err


def _router_update(model, dest, *, reverse: bool):
    """A weight update for ``model`` in ``dest``: a checkpoint holding only
    the last MoE layer's router (an RL trainer pushes the tensors that
    changed), reversed (its experts listed backwards: that layer's routes
    name expert ``E - 1 - e`` where the original's name ``e``; a router's
    input does not depend on its own layer's experts, so every other route
    stays) or as in ``model`` (undoing the update). Returns the whole model
    the engines then run, for the oracle."""
    import shutil

    from safetensors.numpy import load_file, save_file

    dest.mkdir()
    (updated := dest / "model").mkdir()
    (part := dest / "update").mkdir()
    tensors = load_file(model / "model.safetensors")
    last = max(n for n in tensors if n.endswith("mlp.gate.weight"))
    if reverse:
        tensors[last] = tensors[last][::-1].copy()
    for f in model.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, updated)
            shutil.copy(f, part)
    save_file(tensors, updated / "model.safetensors", metadata={"format": "pt"})
    save_file(
        {last: tensors[last]}, part / "model.safetensors", metadata={"format": "pt"}
    )
    return updated, part


def _load_weights(engines, update) -> None:
    """The engines' own weight-update path (``reload_weights`` on every
    worker, from a checkpoint of the changed tensors: reloading every
    tensor of the tiny model from disk changes other routes on the CPU
    build too), then the prefix-cache reset an RL loop does after it; the
    KV pool is emptied, as the user guide asks."""
    import shutil

    for llm in engines:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(update)})
        assert llm.reset_prefix_cache()
    cfg = engines[0].llm_engine.vllm_config.kv_transfer_config
    pool_dir = cfg.kv_connector_extra_config["shared_storage_path"]
    for entry in os.scandir(pool_dir):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


def test_after_a_weight_update_a_pool_hit_has_the_new_weights_routes(
    pool, tiny_moe, tmp_path
):
    """r5 H2: no weight version set (``"default"`` throughout), the routers
    changed through the engines' own weight reload, the prefix cache reset
    on both and the pool emptied. a computes a prompt it computed before
    the update (the tier holds its routes of the old weights under the
    same block hashes); b, loading the pool's new KV, must return the
    routes of the new weights: the reset moved both engines to new keys."""
    a, b = pool
    prompts = pool_prompts("weight-update")
    for out in a.generate(prompts, greedy(2), use_tqdm=False):
        assert_exact(tiny_moe, out.prompt_token_ids, out.outputs[0])
    time.sleep(1.0)  # a's publication thread has mirrored the blocks
    new, update = _router_update(tiny_moe, tmp_path / "new", reverse=True)
    _, undo = _router_update(tiny_moe, tmp_path / "undo", reverse=False)
    _load_weights((a, b), update)
    try:
        for out in a.generate(prompts, greedy(2), use_tqdm=False):
            assert loaded_tokens(out) == 0
            assert_exact(new, out.prompt_token_ids, out.outputs[0])
        time.sleep(1.0)
        for out in b.generate(prompts, greedy(4), use_tqdm=False):
            assert loaded_tokens(out) == from_storage(out) > 0
            assert_exact(new, out.prompt_token_ids, out.outputs[0])
    finally:
        _load_weights((a, b), undo)
