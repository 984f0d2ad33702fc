# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routes across two simulated nodes (issue 29): each node a network
namespace and a mount namespace of its own with a private tmpfs at
``/dev/shm`` (tests/utils/nodes.py), joined by a veth pair, 10.231.29.1 and
10.231.29.2 on a /30; nothing but that pair connects them, and no shared
memory can pass between them. Node A runs the ``mooncake_master`` (bound to
A's address) and engine A; node B runs engine B and a trainer process. Each
engine is a real offline ``LLM`` in its own process (tests/utils/
node_engine.py) with ``backend: mooncake`` (its Mooncake segment on its
node's address, the key space's secret in a 0600 file) and
``ref_transport: mooncake``; the engines share KV through vLLM's
``ExampleConnector`` (one directory on disk, standing in for a shared
filesystem).

- Engine B's hits on KV engine A computed load that KV and return A's
  routes, pulled through the master on node A.
- References engine A handed out are fetched on node B by the trainer
  (``vllm_host_transport.routed_experts.fetch``, neither vLLM nor torch),
  one of them at least from node A's memory.
- The master restarted: both engines serve exactly meanwhile, sharing and
  references come back; the master frozen (SIGSTOP): both engines serve
  exactly without waiting for it, sharing comes back after SIGCONT.

Every array is checked against transformers' router in float32 (computed
here, in the test process). Traffic goes only to the two addresses above
(and each node's own loopback); the namespaces, the veth and the tmpfs
vanish with the module's processes. Needs root (CAP_SYS_ADMIN), ``ip`` and
util-linux's ``unshare``/``nsenter``; skipped with the reason elsewhere."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from utils.nodes import (
    EngineOnNode,
    NodeMaster,
    TrainerOnNode,
    replica_hosts,
    two_nodes,
    unavailable,
)
from utils.oracle import expected_r3
from utils.r3 import (
    PROMPTS,
    assert_exact,
    from_storage,
    loaded_tokens,
    pool_prompts,
)

pytestmark = pytest.mark.engine

mooncake = pytest.importorskip(
    "mooncake.store", reason="Mooncake's client is installed by `make setup`"
)

KEY_SPACE = "test-two-nodes"
BLOCK = 32
# A pull asks the master on the other node and reads the segments of
# either: about 0.1 s here, but 1.4-4.3 s when other suites loaded the 2
# cores (load average 3.5), past the default 1 s (the KV is then
# recomputed, exact, but not loaded).
PULL_TIMEOUT_S = 3.0
# A reference's put goes to whichever segment Mooncake picks, on either
# node; the first puts of A's engine core (new connections) took 5.2 s on
# the loaded machine, past the default 5 s (the request then carries a
# RouteRefPublishError instead of its reference).
REF_HANDOFF_TIMEOUT_S = 15.0
LOGS = Path(__file__).resolve().parents[1] / ".cache" / "logs"


@pytest.fixture(scope="module")
def nodes():
    reason = unavailable()
    if reason:
        pytest.skip(f"no simulated nodes here: {reason}")
    if os.geteuid() != 0:
        pytest.skip("no simulated nodes here: network namespaces need root")
    try:
        cm = two_nodes()
        a, b = cm.__enter__()
    except OSError as e:
        pytest.skip(f"no simulated nodes here: {e}")
    try:
        yield a, b
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture(scope="module")
def master(nodes):
    a, b = nodes
    LOGS.mkdir(parents=True, exist_ok=True)
    m = NodeMaster(a, b, LOGS / "mooncake-master-two-nodes.log")
    m.start()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def engines(nodes, master, tiny_moe, tmp_path_factory):
    """Engine A on node A, engine B on node B, started side by side."""
    secret = tmp_path_factory.mktemp("key-space") / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    storage = tmp_path_factory.mktemp("kv-pool")
    started = []
    try:
        for node in nodes:
            spec = dict(
                model=str(tiny_moe),
                disable_log_stats=False,
                kv_transfer_config={
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(storage)},
                },
                artifact_config=dict(
                    backend="mooncake",
                    key_space=KEY_SPACE,
                    mooncake_master=master.address,
                    mooncake_local_hostname=node.ip,
                    mooncake_segment_bytes=64 << 20,
                    mooncake_buffer_bytes=32 << 20,
                    shared_secret_file=str(secret),
                    shared_pull_timeout_s=PULL_TIMEOUT_S,
                    ref_transport="mooncake",
                    ref_handoff_timeout_s=REF_HANDOFF_TIMEOUT_S,
                ),
            )
            env = dict(os.environ, MC_FORCE_TCP="true", VLLM_HOST_IP=node.ip)
            log = LOGS / f"test-r3-two-nodes-engine-{node.name}.log"
            started.append(EngineOnNode(node, spec, log, env))
        for engine in started:
            engine.wait_ready()
        # The first pulls open B's connections to the other segments: exact
        # either way, loaded once they are open.
        a, b = started
        t0 = time.monotonic()
        tries = _sharing_comes_back(a, b, tiny_moe, "warm-up", 60)
        print(f"first whole hit across the nodes: prompt {tries}, "
              f"{time.monotonic() - t0:.1f} s")  # fmt: skip
        yield tuple(started)
    finally:
        closing = [threading.Thread(target=e.shutdown) for e in started]
        for t in closing:
            t.start()
        for t in closing:
            t.join()


@pytest.fixture(scope="module")
def trainer(nodes, master, tmp_path_factory):
    _, b = nodes
    t = TrainerOnNode(
        b, tmp_path_factory.mktemp("trainer"), LOGS / "test-r3-two-nodes-trainer.log"
    )
    yield t
    t.close()


def _exact(model, out) -> None:
    assert_exact(model, out.prompt_token_ids, out.outputs[0])


def _pulled(engine) -> float:
    """The engine's pulled shared objects; its worker sends the counters
    with a step at most once a second, so wait and take one step first."""
    time.sleep(1.5)
    engine.generate(["Once"], 1)
    return engine.metrics().get("store_shared_pulled_objects", 0.0)


def _assert_fetched_exact(trainer, model, master, out) -> None:
    c = out.outputs[0]
    assert c.routed_experts is None and c.routed_experts_error is None, c
    ref = c.routed_experts_ref
    assert ref["transport"] == "mooncake" and ref["location"] == master.address, ref
    got = trainer.fetch(ref)
    assert isinstance(got, np.ndarray), got
    np.testing.assert_array_equal(
        got, expected_r3(model, out.prompt_token_ids, c.token_ids)
    )
    assert got.any()


def _shm_entries(node) -> set[str]:
    r = node.run(["ls", "-A", "/dev/shm"])
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def test_the_nodes_share_only_the_veth(nodes, engines, master):
    """What the cases below rest on: each node sees its own /dev/shm (its
    engine's store there, nowhere else) and only its loopback and its end
    of the veth, routed to nothing but the /30."""
    a, b = nodes
    devs = {n.name: n.run(["stat", "-c", "%d", "/dev/shm"]).stdout for n in nodes}
    devs["host"] = str(os.stat("/dev/shm").st_dev) + "\n"
    assert len(set(devs.values())) == 3, devs
    stores = {n.name: {e for e in _shm_entries(n) if e.startswith("vart-test-")}
              for n in nodes}  # fmt: skip
    assert all(stores.values()), stores
    assert not stores["a"] & stores["b"], stores
    assert not (stores["a"] | stores["b"]) & set(os.listdir("/dev/shm")), stores
    for node, peer in ((a, b), (b, a)):
        addrs = node.run(["ip", "-o", "-4", "addr", "show"]).stdout.split("\n")
        got = sorted(line.split()[3] for line in addrs if line)
        assert got == sorted(["127.0.0.1/8", f"{node.ip}/30"]), got
        routes = node.run(["ip", "-4", "route", "show"]).stdout.strip()
        assert routes.startswith(f"{node.ip.rsplit('.', 1)[0]}.0/30 dev veth-"), routes
        assert len(routes.splitlines()) == 1, routes
        ok = node.run(["ip", "route", "get", peer.ip])
        assert ok.returncode == 0 and "veth-" in ok.stdout, ok
    assert master.address == f"{a.ip}:{NodeMaster.RPC_PORT}"


def test_hits_on_kv_engine_a_computed(engines, tiny_moe):
    """Engine B loads the KV engine A computed (whole blocks before the last
    prompt token) and returns A's routes for them, pulled through the master
    on node A (from whichever node's segment Mooncake placed them in):
    every row equal to the router."""
    a, b = engines
    prompts = pool_prompts("nodes")
    pulled = _pulled(b)
    for out in a.generate(prompts, 2):
        assert loaded_tokens(out) == 0
        _exact(tiny_moe, out)
    time.sleep(1.0)  # A's publication thread mirrors the blocks off the steps
    outs = b.generate(prompts, 8)
    for out in outs:
        assert loaded_tokens(out) == from_storage(out) > 0
        _exact(tiny_moe, out)
    blocks = sum(loaded_tokens(o) for o in outs) // BLOCK
    assert _pulled(b) == pulled + blocks


def test_references_fetched_on_node_b(nodes, engines, trainer, master, tiny_moe):
    """References engine A handed out name A's master; the trainer on node
    B fetches them, equal to the router, as often as it likes until they
    are removed. A puts them in its own segment (not in whichever engine's
    Mooncake would pick), so every fetch crosses the veth."""
    _, node_b = nodes
    a, _ = engines
    outs = a.generate(PROMPTS, 8, format="ref")
    for out in outs:
        _assert_fetched_exact(trainer, tiny_moe, master, out)
    keys = [o.outputs[0].routed_experts_ref["key"] for o in outs]
    where = replica_hosts(node_b, master.address, keys)
    on_a = [k for k, hosts in where.items() if hosts == [master.host]]
    print(f"references fetched on node B: {len(on_a)} of {len(where)} from node A")
    assert len(on_a) == len(keys), f"references outside node A's memory: {where}"
    _assert_fetched_exact(trainer, tiny_moe, master, outs[0])
    # An object the store does not have: a typed error, across the nodes too.
    gone = dict(outs[0].outputs[0].routed_experts_ref, key="0" * 32)
    assert trainer.fetch(gone) == "RouteRefMissingError"


def test_eight_ranks_on_node_b_read_their_slices(
    nodes, engines, trainer, master, tiny_moe, tmp_path
):
    """8 trainer ranks on node B (2 pipeline stages x 4 data-parallel
    quarters: the tiny model has 2 layers) read their slices of references
    engine A handed out, at once, every byte across the veth
    (tests/utils/slice_readers.py): each equal to transformers' router,
    exactly its bytes plus headers; the last stage of each quarter removes
    what it read, and a read then fails at once."""
    import json
    import sys

    from utils.slice_readers import check

    _, node_b = nodes
    a, _ = engines
    outs = a.generate([f"{p} slices" for p in PROMPTS[:8]], 8, format="ref")
    refs = [o.outputs[0].routed_experts_ref for o in outs]
    want = [
        expected_r3(tiny_moe, o.prompt_token_ids, o.outputs[0].token_ids) for o in outs
    ]
    stages, quarters = 2, 4
    job = {
        "refs": refs,
        "config": str(tiny_moe),
        "stages": stages,
        "halves": quarters,
        "out": str(tmp_path),
        "release": True,
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    assert node_b.ip is not None
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(MC_FORCE_TCP="true", VLLM_MOONCAKE_LOCAL_HOSTNAME=node_b.ip)
    script = Path(__file__).parent / "utils" / "slice_readers.py"
    r = node_b.run(
        [sys.executable, str(script), str(tmp_path / "job.json")],
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    answers = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(answers) == stages * quarters
    check(answers, refs, want, str(tmp_path), quarters)
    assert trainer.fetch(refs[0]) == "RouteRefMissingError"


def _sharing_comes_back(a, b, model, tag: str, deadline_s: float) -> int:
    """Prompts computed by A and then asked of B, until B loads a whole hit
    (exact every time, whole blocks); returns how many it took."""
    deadline = time.monotonic() + deadline_s
    for i in range(1000):
        prompt = f"{i} {tag} {pool_prompts(tag)[0]}"
        a.generate([prompt], 1)
        time.sleep(1.0)
        (out,) = b.generate([prompt], 4)
        # While the clients rejoin, some of A's writes may still fail: B then
        # takes part of the hit, or none of it, exact every time.
        _exact(model, out)
        assert loaded_tokens(out) % BLOCK == 0
        if loaded_tokens(out) == from_storage(out):
            return i + 1
        assert time.monotonic() < deadline, f"sharing never came back ({tag})"
    raise AssertionError("unreachable")


def test_master_restarted(engines, master, tiny_moe):
    """The master stopped: B recomputes the KV of A's prompt (the tier is
    gone, its routes with it), A serves its own prompts, references say
    why they are missing; the master started again (empty): sharing and
    references come back, exact."""
    a, b = engines
    before, during = (pool_prompts(t)[0] for t in ("restart-before", "restart-down"))
    a.generate([before], 2)
    time.sleep(1.0)
    master.stop()
    try:
        (out,) = b.generate([before], 4)
        assert loaded_tokens(out) == 0
        _exact(tiny_moe, out)
        for engine in (a, b):
            (out,) = engine.generate([during], 4)
            _exact(tiny_moe, out)
        (down,) = a.generate([PROMPTS[4]], 4, format="ref")
        assert down.outputs[0].routed_experts_ref is None
        assert down.outputs[0].routed_experts_error.startswith(
            "RouteRefPublishError"
        ), down.outputs[0].routed_experts_error
    finally:
        master.start()
    tries = _sharing_comes_back(a, b, tiny_moe, "restart-back", 60)
    print(f"sharing back after the restart in {tries} prompt(s)")
    deadline = time.monotonic() + 60
    while True:
        (again,) = a.generate([PROMPTS[1]], 8, format="ref")
        if again.outputs[0].routed_experts_ref is not None:
            break
        assert time.monotonic() < deadline, again.outputs[0].routed_experts_error
        time.sleep(1.0)


def test_trainer_fetches_after_master_restart(engines, trainer, master, tiny_moe):
    """A trainer whose Mooncake client joined before the master restarted
    fetches the references handed out after it (on node B, from A's new
    objects), exact."""
    a, _ = engines
    (first,) = a.generate([PROMPTS[0]], 4, format="ref")
    _assert_fetched_exact(trainer, tiny_moe, master, first)  # joined now
    master.stop()
    try:
        # The store is gone with its master: typed, never a partial array.
        gone = trainer.fetch(first.outputs[0].routed_experts_ref)
        assert gone in ("RouteRefTransportError", "RouteRefMissingError"), gone
    finally:
        master.start()
    deadline = time.monotonic() + 60
    while True:
        (out,) = a.generate([PROMPTS[2]], 8, format="ref")
        if out.outputs[0].routed_experts_ref is not None:
            break
        assert time.monotonic() < deadline, out.outputs[0].routed_experts_error
        time.sleep(1.0)
    _assert_fetched_exact(trainer, tiny_moe, master, out)


def test_master_frozen(engines, master, tiny_moe):
    """The master frozen (SIGSTOP: every Mooncake call to it hangs, up to
    Mooncake's own 30 s timeout): both engines keep serving, exactly and
    before it resumes; B recomputes the KV of A's prompt, nothing stays
    retained. After SIGCONT, sharing comes back."""
    a, b = engines
    before, new = (pool_prompts(t)[0] for t in ("frozen-before", "frozen-new"))
    a.generate([before], 2)
    time.sleep(1.0)
    master.freeze()
    t0 = time.monotonic()
    try:
        (out,) = b.generate([before], 4)
        assert loaded_tokens(out) == 0
        _exact(tiny_moe, out)
        for engine in (a, b):  # a local prefix hit each, and new prompts
            outs = engine.generate([before, f"{engine.node.name} {new}"], 4)
            assert loaded_tokens(outs[0]) > 0
            for out in outs:
                _exact(tiny_moe, out)
        served_s = time.monotonic() - t0
        time.sleep(1.5)  # the workers' counters come with a step, once a second
        for engine in (a, b):
            engine.generate(["Once"], 1)
            assert engine.metrics()["store_retained_objects"] == 0
    finally:
        master.thaw()
    # Mooncake would hold each call 30 s: the engines waited for none.
    assert served_s < 25.0, f"{served_s:.1f} s with the master frozen"
    print(f"served with the master frozen in {served_s:.1f} s")
    tries = _sharing_comes_back(a, b, tiny_moe, "thawed", 90)
    print(f"sharing back after the thaw in {tries} prompt(s)")
