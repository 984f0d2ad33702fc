# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""R3 under data and expert parallelism on the CPU harness, row by row
against transformers' router in float32.

* Data parallelism 2 (``vllm serve --data-parallel-size 2``: two engine
  cores, each with its own worker on its own core): one store per rank
  under the root, exact routes on both ranks (requests pinned to a rank
  with ``X-data-parallel-rank``, and unpinned ones spread by the load
  balancer), exact prefix hits on both ranks, a request served while the
  other rank is idle (it runs dummy forwards and publishes nothing), and
  nothing left under the root after the shutdown.
* Expert parallelism: tensor parallelism 2 (offline ``LLM``) and data
  parallelism 2 (``vllm serve``) with ``enable_expert_parallel``: each rank
  holds half the experts, and the routes are still the logical expert IDs,
  equal to the run without expert parallelism and to the oracle.

On CPU the base lacks the MoE collectives of data parallelism and its CPU
experts ignore the expert map; the harness fills both in
(``tools/cpu_harness/cpu_parallel.py``), tested first here.

The engines start one at a time (the machine has two cores): each engine
fixture closes the previous engine before it starts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from harness_env import run_tmpdir
from utils.oracle import expected_r3
from utils.r3 import (
    BLOCK_SIZE,
    PROMPTS,
    SHARED_PREFIX,
    assert_exact,
    assert_nothing_retained,
    engine_kwargs,
    greedy,
    pickled_rpc,
    r3_server,
    serve_flags,
    shm_root,
)
from utils.tp import rank_facts

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tools" / "cpu_harness"
NUM_EXPERTS = 8  # the tiny MoE's
# The prompts whose routes the expert-parallel engines must reproduce: the
# routes of the data-parallel engine without expert parallelism.
EP_PROMPTS = [*PROMPTS[:3], SHARED_PREFIX + "Expert parallel engines route alike."]


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# One CPU worker per rank, each on its own core (cpu-harness notes); under
# data parallelism the list is split by rank ([DP, PP, TP] order).
BIND_TWO_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


# ------------------------------------------------ the harness's shims
_RANK_SCRIPT = r"""
import json, os, sys, types
sys.path.insert(0, sys.argv[3])
import torch, torch.distributed as dist
import cpu_parallel
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2],
                        rank=rank, world_size=2)
comm = types.SimpleNamespace(world_size=2, rank_in_group=rank, device_group=None)
sizes = [3, 1]
mine = torch.arange(sizes[rank] * 2, dtype=torch.float32).reshape(-1, 2) + 10 * rank
ids = torch.full((sizes[rank], 2), rank, dtype=torch.int32)
gathered, gathered_ids = cpu_parallel.all_gatherv(comm, [mine, ids], 0, sizes)
full = torch.arange(8, dtype=torch.float32).reshape(4, 2) * (rank + 1)
scattered = cpu_parallel.reduce_scatterv(comm, full, 0, sizes)
even = cpu_parallel.all_gatherv(comm, torch.tensor([[rank]]), 0, None)
print(json.dumps({"gathered": gathered.tolist(), "ids": gathered_ids.tolist(),
                  "ids_dtype": str(gathered_ids.dtype),
                  "scattered": scattered.tolist(), "even": even.tolist()}))
dist.destroy_process_group()
"""


def test_harness_collectives_gather_and_scatter_uneven_counts(tmp_path):
    """``all_gatherv`` / ``reduce_scatterv`` on a real two-rank gloo group,
    with 3 tokens on rank 0 and 1 on rank 1 (what a busy rank and an idle
    rank's dummy batch look like)."""
    store = tmp_path / "rendezvous"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_FORK_CPU_HARNESS"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT, str(r), str(store), str(HARNESS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for r in (0, 1)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    rows0 = [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    for res in results:
        assert res["gathered"] == [*rows0, [10.0, 11.0]]  # rank order, unpadded
        assert res["ids"] == [[0, 0]] * 3 + [[1, 1]]
        assert res["ids_dtype"] == "torch.int32"
        assert res["even"] == [[0], [1]]
    # The sum over ranks (x1 + x2 = x3) of each rank's own rows.
    full3 = (np.arange(8, dtype=np.float32).reshape(4, 2) * 3).tolist()
    assert results[0]["scattered"] == full3[:3]
    assert results[1]["scattered"] == full3[3:]


def test_harness_experts_map_global_ids_to_local_slots():
    import cpu_parallel
    import torch

    # Rank 1 of two: it holds global experts 4..7 in slots 0..3.
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32)
    ids = torch.tensor([[5, 1], [0, 7]], dtype=torch.int32)
    weights = torch.tensor([[0.6, 0.4], [0.3, 0.7]])
    w, local = cpu_parallel.local_expert_ids(weights, ids, expert_map)
    assert local.tolist() == [[1, 0], [0, 3]] and local.dtype == ids.dtype
    assert torch.equal(w, torch.tensor([[0.6, 0.0], [0.0, 0.7]]))


def test_harness_patches_the_cpu_classes_in_every_process():
    """The ``.pth`` hook patched the classes when vLLM imported them (the
    engine's processes run the same hook)."""
    import cpu_parallel

    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )
    from vllm.distributed.device_communicators.cpu_communicator import (
        CpuCommunicator,
    )
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        CPUUnquantizedExperts,
    )

    for name in ("all_gatherv", "reduce_scatterv"):
        assert getattr(CpuCommunicator, name) is not getattr(
            DeviceCommunicatorBase, name
        )
        assert getattr(CpuCommunicator, name) is getattr(cpu_parallel, name)
    assert hasattr(CPUUnquantizedExperts.apply, "__wrapped__")


# ------------------------------------------------ helpers of the served engines
def _complete(srv, prompt, rank: int | None = None, max_tokens: int = 8) -> dict:
    """A greedy ``/v1/completions`` (token ids returned), pinned to a
    data-parallel rank when ``rank`` is given."""
    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    headers = {"Content-Type": "application/json"}
    if rank is not None:
        headers["X-data-parallel-rank"] = str(rank)
    req = urllib.request.Request(
        srv.base_url + "/v1/completions", json.dumps(body).encode(), headers
    )
    with urllib.request.urlopen(req, timeout=180) as resp:
        return json.loads(resp.read())


def _routes(model, body: dict) -> np.ndarray:
    """The answer's routes, checked against transformers' router."""
    from vllm.utils.routed_experts_codec import decode_routed_experts

    (choice,) = body["choices"]
    assert choice.get("routed_experts") is not None, choice
    assert choice.get("routed_experts_error") is None, choice
    got = decode_routed_experts(choice["routed_experts"])
    want = expected_r3(model, choice["prompt_token_ids"], choice["token_ids"])
    assert got.shape == want.shape, (got.shape, want.shape)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{len(bad)} routes differ, first at {bad[0].tolist()}"
    return got


def _cached(body: dict) -> int:
    details = body["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def _objects_per_store(root: str) -> dict[str, int]:
    """Live objects of each store (namespace) under ``root``."""
    from vllm.distributed.artifact_connector.shm import ShmStoreReader

    counts = {}
    for ns in sorted(os.listdir(root)):
        reader = ShmStoreReader(root, ns)
        try:
            counts[ns] = len(reader._index.live_slots())
        finally:
            reader.close()
    return counts


def _grown(before: dict[str, int], after: dict[str, int]) -> list[str]:
    return [ns for ns in after if after[ns] > before.get(ns, 0)]


class Served:
    """A ``vllm serve`` that a test may stop before the module ends."""

    def __init__(self, model, extra: list[str], log_name: str):
        self.root = shm_root()
        self._stack = contextlib.ExitStack()
        with _env(**BIND_TWO_CORES):
            flags = serve_flags(self.root) + extra
            self.srv = self._stack.enter_context(
                r3_server(model, flags, self.root, log_name)
            )
        self.rank_of: dict[str, int] = {}  # store namespace -> DP rank

    @property
    def closed(self) -> bool:
        return self.srv is None

    def close(self) -> None:
        """Stop the server; ``r3_server`` asserts the root is gone."""
        if self.srv is not None:
            self.srv = None
            self._stack.close()


_ENGINES: list = []  # the engine (Served or LLM) running now, at most one


def _stop_all() -> None:
    """Close this module's running engine (one engine at a time)."""
    while _ENGINES:
        _stop(_ENGINES[-1])


def _stop(engine) -> None:
    if engine not in _ENGINES:
        return
    _ENGINES.remove(engine)
    if isinstance(engine, Served):
        engine.close()
    else:
        # A generous timeout: on a loaded 2-core machine the default 5 s
        # can expire before the workers remove their files.
        engine.llm_engine.engine_core.shutdown(timeout=30)
        gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _close_engines_at_the_end():
    with pickled_rpc():
        yield
        _stop_all()


# ------------------------------------------------ data parallelism 2
@pytest.fixture(scope="module")
def dp2(tiny_moe):
    _stop_all()
    engine = Served(tiny_moe, ["--data-parallel-size", "2"], "test-r3-dp2.log")
    _ENGINES.append(engine)
    yield engine
    _stop(engine)


def _live(engine: Served):
    if engine.closed:
        pytest.fail("the data-parallel engine was already shut down")
    return engine.srv


def test_dp2_one_store_per_rank_requests_land_on_both(dp2, tiny_moe):
    srv = _live(dp2)
    namespaces = sorted(os.listdir(dp2.root))
    assert len(namespaces) == 2, namespaces  # two stores while it runs
    for rank in (0, 1):
        before = _objects_per_store(dp2.root)
        _routes(tiny_moe, _complete(srv, PROMPTS[rank], rank=rank))
        (grown,) = _grown(before, _objects_per_store(dp2.root))
        dp2.rank_of[grown] = rank
    # Each rank published into its own store, the other one's untouched.
    assert sorted(dp2.rank_of) == namespaces
    assert sorted(dp2.rank_of.values()) == [0, 1]


def test_dp2_routes_exact_on_both_ranks(dp2, tiny_moe):
    srv = _live(dp2)
    for rank in (0, 1):
        for prompt in PROMPTS[2:5]:
            _routes(tiny_moe, _complete(srv, prompt, rank=rank))
    # Unpinned and concurrent: the load balancer spreads them over both
    # ranks (each store grows).
    before = _objects_per_store(dp2.root)
    prompts = [f"Request {i}: " + PROMPTS[i % len(PROMPTS)] for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        bodies = list(pool.map(lambda p: _complete(srv, p, max_tokens=12), prompts))
    for body in bodies:
        _routes(tiny_moe, body)
    assert sorted(_grown(before, _objects_per_store(dp2.root))) == sorted(
        os.listdir(dp2.root)
    ), "every unpinned request landed on one rank"


def test_dp2_prefix_hits_exact_on_both_ranks(dp2, tiny_moe):
    srv = _live(dp2)
    for rank in (0, 1):
        # Its own first block per rank: no block of it was cached before.
        prompt = f"Asked on rank {rank}, twice over: " + SHARED_PREFIX
        first = _complete(srv, prompt, rank=rank)
        again = _complete(srv, prompt, rank=rank)
        # Each rank has its own KV cache: the other rank never saw it.
        elsewhere = _complete(srv, prompt, rank=1 - rank)
        assert _cached(first) == 0
        assert _cached(again) >= 3 * BLOCK_SIZE, again["usage"]
        assert _cached(elsewhere) == 0, elsewhere["usage"]
        rows = _routes(tiny_moe, first)
        np.testing.assert_array_equal(_routes(tiny_moe, again), rows)
        np.testing.assert_array_equal(_routes(tiny_moe, elsewhere), rows)


def test_dp2_request_completes_while_the_other_rank_is_idle(
    dp2, tiny_moe, record_property
):
    """Rank-0 requests with rank 1 idle (rank 1 then runs dummy forwards
    to meet rank 0's MoE collectives, and publishes nothing), against the
    same requests with rank 1 busy decoding; the latencies are printed and
    recorded (``dp2_latency_s``), not asserted."""
    srv = _live(dp2)
    idle_ns = next(ns for ns, r in dp2.rank_of.items() if r == 1)
    prompt, n, reps = PROMPTS[1], 32, 3
    _complete(srv, prompt, rank=0, max_tokens=n)  # warm (prefix cached)

    bodies = []  # checked after the measurements

    def timed() -> float:
        t0 = time.monotonic()
        bodies.append(_complete(srv, prompt, rank=0, max_tokens=n))
        return time.monotonic() - t0

    before = _objects_per_store(dp2.root)
    idle = [timed() for _ in range(reps)]
    after = _objects_per_store(dp2.root)
    assert after[idle_ns] == before[idle_ns], "the idle rank published"

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Long enough to outlast the measurement (about 13 s here).
        other = pool.submit(_complete, srv, PROMPTS[4], 1, 600)
        time.sleep(0.5)  # rank 1 is decoding
        busy = [timed() for _ in range(reps)]
        assert not other.done(), "rank 1 finished before the measurement ended"
        bodies.append(other.result())
    for body in bodies:
        _routes(tiny_moe, body)
    figures = {"tokens": n, "rank1_idle": idle, "rank1_busy": busy}
    record_property("dp2_latency_s", figures)

    def ms(xs: list[float]) -> str:
        return ", ".join(f"{1000 * x / n:.1f}" for x in xs)

    print(
        f"\n[dp2] {n} tokens on rank 0, ms/token: rank 1 idle {ms(idle)}; "
        f"rank 1 busy {ms(busy)}"
    )


@pytest.fixture(scope="module")
def no_ep_routes(dp2, tiny_moe) -> dict[str, dict]:
    """The answers of the engine without expert parallelism (rank 0)."""
    srv = _live(dp2)
    return {p: _complete(srv, p, rank=0) for p in EP_PROMPTS}


def test_dp2_shutdown_leaves_nothing_under_the_root(dp2, no_ep_routes):
    root = dp2.root
    assert len(os.listdir(root)) == 2
    _stop(dp2)  # r3_server asserts the root is gone
    assert not os.path.exists(root)
    leftovers = [e for e in os.listdir("/dev/shm") if e.startswith("vart-test-")]
    assert os.path.basename(root) not in leftovers


# ------------------------------------------------ expert parallelism
def _assert_same_as_without_ep(prompt, ids, token_ids, rows, no_ep) -> None:
    ref = no_ep[prompt]["choices"][0]
    assert list(ids) == ref["prompt_token_ids"]
    assert list(token_ids) == ref["token_ids"]
    from vllm.utils.routed_experts_codec import decode_routed_experts

    np.testing.assert_array_equal(rows, decode_routed_experts(ref["routed_experts"]))


def _ep_facts(worker) -> dict:
    """This rank's expert placement in the first MoE layer."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    model = worker.model_runner.model
    layer = next(m for m in model.modules() if isinstance(m, RoutedExperts))
    emap = layer.expert_map
    return {
        "local_num_experts": layer.local_num_experts,
        "global_experts": (
            None if emap is None else (emap >= 0).nonzero().flatten().tolist()
        ),
    }


@pytest.fixture(scope="module")
def tp2_ep_llm(tiny_moe, no_ep_routes):
    from vllm import LLM

    _stop_all()  # the reference engine stops first
    # A private TMPDIR for the engine's processes: its file:// rendezvous
    # then cannot be removed by another test session's clean-up of
    # .cache/tmp while the ranks meet (seen here: both workers hung in
    # init_process_group).
    tmp = run_tmpdir("tp2-ep")
    try:
        with _env(TMPDIR=str(tmp), **BIND_TWO_CORES):
            engine = LLM(
                **engine_kwargs(
                    tiny_moe, tensor_parallel_size=2, enable_expert_parallel=True
                )
            )
        _ENGINES.append(engine)
        yield engine
        _stop(engine)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_ep_tp2_routes_are_logical_expert_ids(tp2_ep_llm, tiny_moe, no_ep_routes):
    llm = tp2_ep_llm
    # Expert parallelism is really on: each rank holds half the experts.
    facts = llm.collective_rpc(_ep_facts)
    assert [f["local_num_experts"] for f in facts] == [NUM_EXPERTS // 2] * 2
    held = [f["global_experts"] for f in facts]
    assert sorted(held[0] + held[1]) == list(range(NUM_EXPERTS)), held

    outs = llm.generate(EP_PROMPTS, greedy(8), use_tqdm=False)
    for prompt, out in zip(EP_PROMPTS, outs):
        c = out.outputs[0]
        assert_exact(tiny_moe, out.prompt_token_ids, c)
        _assert_same_as_without_ep(
            prompt, out.prompt_token_ids, c.token_ids,
            c.routed_experts, no_ep_routes,
        )  # fmt: skip
    # Logical IDs, not local slots: experts of both ranks appear.
    rows = np.concatenate([o.outputs[0].routed_experts for o in outs])
    assert set(np.unique(rows).tolist()) == set(range(NUM_EXPERTS))
    # A prefix hit returns the same logical routes.
    (again,) = llm.generate([EP_PROMPTS[-1]], greedy(8), use_tqdm=False)
    assert (again.num_cached_tokens or 0) >= 3 * BLOCK_SIZE
    np.testing.assert_array_equal(
        assert_exact(tiny_moe, again.prompt_token_ids, again.outputs[0]),
        outs[-1].outputs[0].routed_experts,
    )
    # Both ranks captured the same (logical) last route; rank 0 publishes.
    (last,) = llm.generate([PROMPTS[3]], greedy(), use_tqdm=False)
    want = assert_exact(tiny_moe, last.prompt_token_ids, last.outputs[0])
    rank0, rank1 = llm.collective_rpc(rank_facts)
    for rank in (rank0, rank1):
        assert rank["capture_row0"] == want[-1].tolist(), rank
    assert rank0["publishes"] and not rank1["publishes"]
    assert_nothing_retained(llm)


@pytest.fixture(scope="module")
def dp2_ep(tiny_moe, no_ep_routes):
    _stop_all()
    engine = Served(
        tiny_moe,
        ["--data-parallel-size", "2", "--enable-expert-parallel"],
        "test-r3-dp2-ep.log",
    )
    _ENGINES.append(engine)
    yield engine
    _stop(engine)


def test_ep_dp2_routes_are_logical_expert_ids(dp2_ep, tiny_moe, no_ep_routes):
    srv = _live(dp2_ep)
    assert len(os.listdir(dp2_ep.root)) == 2
    rows = []
    for rank in (0, 1):
        for prompt in EP_PROMPTS:
            body = _complete(srv, prompt, rank=rank)
            got = _routes(tiny_moe, body)
            choice = body["choices"][0]
            _assert_same_as_without_ep(
                prompt, choice["prompt_token_ids"], choice["token_ids"],
                got, no_ep_routes,
            )  # fmt: skip
            rows.append(got)
        # A prefix hit on this rank.
        again = _complete(srv, EP_PROMPTS[-1], rank=rank)
        assert _cached(again) >= 3 * BLOCK_SIZE, again["usage"]
        np.testing.assert_array_equal(_routes(tiny_moe, again), rows[-1])
    assert set(np.unique(np.concatenate(rows)).tolist()) == set(range(NUM_EXPERTS))
    root = dp2_ep.root
    _stop(dp2_ep)  # r3_server asserts the root is gone
    assert not os.path.exists(root)
