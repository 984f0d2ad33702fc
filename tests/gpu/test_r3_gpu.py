# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""R3 on the GPU: the fork's Model Runner V2 path on a real device.

Meant for the GPU harness (../shared/tools/gpu/README.md): the fork's Python
tree on PYTHONPATH (``/tmp/site``), the pristine 0.32.0 tree in
``R3_BASE_SITE`` (default ``/tmp/site_base``, unpacked from
``.devcarry/base_site.tgz`` when missing), a tiny real-weight Qwen3-MoE in
``R3_GPU_MODEL`` (default ``.devcarry/models/tiny-moe``, built with
``tools/build_tiny_moe.py --layers 3 --experts 16 --top-k 4``), float32,
eager, TRITON_ATTN, the Triton MoE.

Each engine runs in its own process (``r3_engine.py``), all of them at once:

- ``ref``:     the fork, async scheduling (default), no chunking;
- ``chunked``: the fork, ``max_num_batched_tokens=64`` (prompts of 260-600
  tokens are prefilled in chunks);
- ``sync``:    the fork, ``async_scheduling=False``;
- ``sync_chunked``: both;
- ``base``:    the pristine tree's own AuxOutput R3, as ``ref``;
- ``ref_ieee``, ``chunked_ieee``: ``ref`` and ``chunked`` with
  ``TRITON_F32_DEFAULT=ieee`` (Triton's float32 dots in full float32 instead
  of TF32, the default);
- ``spec``: ``ref`` with Model Runner V2's n-gram speculator (3 draft tokens,
  lookup 1..4), async scheduling on. The method is ``ngram_gpu``: 0.32.0's
  config refuses ``method="ngram"`` with async scheduling on (only EAGLE/MTP/
  draft model/``ngram_gpu``/DSpark/DFlash may; ``spec_sync`` records the
  refusal) and Model Runner V2 runs the same ``NgramGPUSpeculator`` for both
  names;
- ``spec_sync``: ``method="ngram"`` as such, async left to the config (it
  turns async scheduling off for ``ngram``);
- ``spec_ieee``: ``spec`` in IEEE float32;
- ``tp2``, ``tp2_ieee``, ``tp2_chunked_ieee``, ``tp2_sync_ieee``: ``ref``,
  ``ref_ieee``, ``chunked_ieee`` and ``ref_ieee`` with async scheduling off,
  at tensor parallelism 2 (two GPUs; skipped with fewer). Each must equal
  its TP=1 case (``TP_REF``) up to near-ties, every rank must capture
  (equal capture buffers) and only global rank 0 may publish and hold the
  store.
- ``eplb``, ``eplb_async``: ``ref`` with expert load balancing (EPLB) and
  expert parallelism on one GPU (EP size 1: 0.32.0's config refuses this,
  r3_engine.py switches it on after validation), 4 redundant experts (16
  logical, 20 physical), rebalancing every 20 steps from the first round on
  (synchronous resp. asynchronous rearrangement); ``eplb_graphs``: ``eplb``
  under ``graphs``' full CUDA graphs (the maps are updated in place, under
  replayed graphs), against ``graphs``; ``tp2_eplb``: ``eplb`` at
  TP=2 (EP size 2; two GPUs, skipped with fewer). Round 1 runs on the
  initial placement, rounds 2 and 3 after rebalancing steps. The returned
  IDs must be logical (below 16) and equal their case without EPLB
  (``EPLB_REF``) up to near-ties in every round, tokens equal; the
  placement must have changed.

``ref``, ``ref_ieee`` and the ``spec*`` cases run a third round: four
prompts with repetition (the prefix, then a short pattern repeated, or a
stretch of the prefix copied), 32 new tokens each. The speculative cases'
routes must have the usual shape ``[N-1, L, K]`` (rows of rejected drafts
dropped, rows of accepted ones kept), equal the non-speculative case's rows
over the tokens both generated alike (greedy; up to near-ties, as for any
routes computed in other batch shapes), and match transformers. Drafts must
have been proposed, accepted and rejected (per-request acceptance metrics).

What must be exact and what may differ by numerics. Rows served from the
prefix cache (replayed from the store) and the fork against the base (same
kernels, same batches) must be bitwise equal. Routes *computed* in different
batch shapes (chunked or not, async or not, round 1 across prompts) and the
oracle (transformers on the CPU) may differ only at near-ties: wherever two
routes differ, the experts exchanged must have router logits (transformers,
float32) within ``TIE_TOL`` (0.05 with TF32 kernels, 1e-3 in IEEE float32;
the median gap between adjacent top-k logits of this model is about 1.1),
and such entries must stay rare (at most 1% resp. 0.1% of an array).
Every comparison's exact-mismatch count is written to ``comparisons.json``.

Each engine runs two rounds (16 new tokens each): six prompts sharing a
256-token prefix, then the same six (prefix-cache hits) and two new ones with
the same prefix; ``ref``, ``ref_ieee`` and ``spec*`` add the third round of
prompts with repetition described above. Results (JSON + routes) land in
``R3_GPU_OUT`` (default ``$OUT/r3_gpu``).

Run there through ``tests/gpu/device_run.sh`` (``python3 -m pytest -q
--confcutdir=tests/gpu -p no:cacheprovider tests/gpu``; ``--confcutdir`` keeps
the CPU harness's tests/conftest.py out), or ``python3 tests/gpu/test_r3_gpu.py``
without pytest. ``R3_GPU_REPLAY=1 R3_GPU_OUT=<unpacked r3_gpu/>`` judges a
device run's saved results again on any machine (no engine starts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

try:
    import pytest
except ImportError:  # script mode on a machine without pytest
    pytest = None

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
from r3_engine import PREFIX_LEN, ROUND1, ROUND2, ROUND_REP  # noqa: E402

MODEL = Path(os.environ.get("R3_GPU_MODEL", ROOT / ".devcarry" / "models" / "tiny-moe"))
OUT = Path(os.environ.get("R3_GPU_OUT", Path(os.environ.get("OUT", "/tmp")) / "r3_gpu"))
BASE_SITE = Path(os.environ.get("R3_BASE_SITE", "/tmp/site_base"))
BASE_TGZ = ROOT / ".devcarry" / "base_site.tgz"
TIMEOUT_S = float(os.environ.get("R3_GPU_ENGINE_TIMEOUT", "240"))
# Serial retries of failed engines only while the whole collection is younger
# than this (a broken fork must not eat the device call with retries).
RETRY_BUDGET_S = float(os.environ.get("R3_GPU_RETRY_BUDGET", "200"))

# Three rounds: the six prompts, their prefix-cache hits plus two new ones,
# and the prompts with repetition (32 new tokens).
ROUNDS3 = {"rounds": [ROUND1, ROUND2, ROUND_REP], "round_max_tokens": [16, 16, 32]}
GRAPHS = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
NGRAM = {"num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
CASES = {
    "ref": {"tree": "fork", "async": None, "max_batched": 4096, **ROUNDS3},
    "chunked": {"tree": "fork", "async": None, "max_batched": 64},
    "sync": {"tree": "fork", "async": False, "max_batched": 4096},
    "sync_chunked": {"tree": "fork", "async": False, "max_batched": 64},
    "base": {"tree": "base", "async": None, "max_batched": 4096},
    "ref_ieee": {
        "tree": "fork",
        "async": None,
        "max_batched": 4096,
        "f32": "ieee",
        **ROUNDS3,
    },
    "chunked_ieee": {"tree": "fork", "async": None, "max_batched": 64, "f32": "ieee"},
    "spec": {
        "tree": "fork",
        "async": True,
        "max_batched": 4096,
        "speculative": {"method": "ngram_gpu", **NGRAM},
        **ROUNDS3,
    },
    "spec_sync": {
        "tree": "fork",
        "async": None,
        "expect_async": False,  # the config turns it off for "ngram"
        "max_batched": 4096,
        "speculative": {"method": "ngram", **NGRAM},
        "probe_ngram_async": True,
        **ROUNDS3,
    },
    "spec_ieee": {
        "tree": "fork",
        "async": True,
        "max_batched": 4096,
        "f32": "ieee",
        "speculative": {"method": "ngram_gpu", **NGRAM},
        **ROUNDS3,
    },
    # Full CUDA graphs for decode, compiled mode off (the stand-ins are not
    # torch.library ops): the capture runs inside a replayed graph.
    "graphs": {
        "tree": "fork",
        "async": None,
        "max_batched": 4096,
        "override": {"enforce_eager": False, "compilation_config": GRAPHS},
        **ROUNDS3,
    },
    "graphs_ieee": {
        "tree": "fork",
        "async": None,
        "max_batched": 4096,
        "f32": "ieee",
        "override": {"enforce_eager": False, "compilation_config": GRAPHS},
        **ROUNDS3,
    },
    "base_graphs": {
        "tree": "base",
        "async": None,
        "max_batched": 4096,
        "override": {"enforce_eager": False, "compilation_config": GRAPHS},
    },
    "tp2": {"tree": "fork", "async": None, "max_batched": 4096, "tp": 2},
    "tp2_ieee": {
        "tree": "fork",
        "async": None,
        "max_batched": 4096,
        "f32": "ieee",
        "tp": 2,
    },
    "tp2_chunked_ieee": {
        "tree": "fork",
        "async": None,
        "max_batched": 64,
        "f32": "ieee",
        "tp": 2,
    },
    "tp2_sync_ieee": {
        "tree": "fork",
        "async": False,
        "max_batched": 4096,
        "f32": "ieee",
        "tp": 2,
    },
}
EPLB = {
    "num_redundant_experts": 4,
    "window_size": 16,
    "step_interval": 20,
    "use_async": False,
    "communicator": "torch_gloo",
}
CASES["eplb"] = {"tree": "fork", "async": None, "max_batched": 4096, "eplb": EPLB}
# Routes by reference, fetched by a trainer process without vLLM or torch.
CASES["handoff"] = {"tree": "fork", "async": None, "max_batched": 4096, "by_ref": True}
CASES["eplb"].update(ROUNDS3)
CASES["eplb_async"] = dict(CASES["eplb"], eplb=dict(EPLB, use_async=True))
CASES["eplb_graphs"] = dict(
    CASES["eplb"],
    override={"enforce_eager": False, "compilation_config": GRAPHS},
)
CASES["tp2_eplb"] = dict(CASES["eplb"], tp=2)
# (largest logit gap of an exchanged pair, largest share of differing entries
# per compared array) by numerics: TF32 Triton dots (the default) or IEEE.
TIE_TOL = {None: (0.05, 0.01), "ieee": (1e-3, 1e-3)}
MOE_LIBRARY = "_moe_C_stable_libtorch.abi3.so"
FORK_CASES = [c for c, s in CASES.items() if s["tree"] == "fork"]
# speculative case -> the non-speculative case it must agree with
SPEC_REF = {"spec": "ref", "spec_sync": "ref", "spec_ieee": "ref_ieee"}
# tensor-parallel case -> the TP=1 case it must equal
TP_REF = {
    "tp2": "ref",
    "tp2_ieee": "ref_ieee",
    "tp2_chunked_ieee": "chunked_ieee",
    "tp2_sync_ieee": "ref_ieee",
}


class Run:
    """One engine's results: ``meta`` (JSON) and ``routes[(round, prompt)]``."""

    def __init__(
        self, name: str, meta: dict, routes: dict, log: str, probe=None
    ) -> None:
        self.name, self.meta, self.routes, self.log = name, meta, routes, log
        self.probe = probe  # the TP cases' last request alone

    def outs(self, rnd: int) -> dict[int, dict]:
        return {d["prompt"]: d for d in self.meta["rounds"][rnd]["outs"]}


def _base_pythonpath() -> str:
    if not BASE_SITE.is_dir() and BASE_TGZ.is_file():
        BASE_SITE.mkdir(parents=True, exist_ok=True)
        with tarfile.open(BASE_TGZ) as tf:
            tf.extractall(BASE_SITE)
    rest = os.environ.get("PYTHONPATH", "")
    return f"{BASE_SITE}:{rest}" if rest else str(BASE_SITE)


def _launch(name: str, spec: dict) -> subprocess.Popen:
    env = dict(os.environ)
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    env.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fn)
    # One engine per process already; the TP cases keep the EngineCore in
    # its own process, as the GPU harness's TP=2 case was proven with.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("tp", 1) > 1 else "0"
    if spec["tree"] == "base":
        env["PYTHONPATH"] = _base_pythonpath()
    if spec.get("f32"):
        env["TRITON_F32_DEFAULT"] = spec["f32"]
        env["TRITON_CACHE_DIR"] = f"/tmp/triton_cache_{spec['f32']}"
    spec = dict(spec, model=str(MODEL))
    log = open(OUT / f"{name}.log", "w")  # noqa: SIM115 (the child writes it)
    return subprocess.Popen(
        [sys.executable, str(HERE / "r3_engine.py"), json.dumps(spec), str(OUT / name)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=str(ROOT),
    )


def _load(name: str) -> Run:
    log = (OUT / f"{name}.log").read_text(errors="replace")
    try:
        meta = json.loads((OUT / f"{name}.json").read_text())
    except (OSError, ValueError):
        meta = {"ok": False, "error": "no result file"}
    routes, probe = {}, None
    if meta.get("ok"):
        with np.load(OUT / f"{name}.npz") as z:
            for k in z.files:
                if k == "probe":
                    probe = z[k]
                    continue
                r, p = k[1:].split("_p")
                routes[(int(r), int(p))] = z[k]
    return Run(name, meta, routes, log, probe)


def collect_runs() -> dict[str, Run]:
    OUT.mkdir(parents=True, exist_ok=True)
    serial = os.environ.get("R3_GPU_SERIAL") == "1"
    names = os.environ.get("R3_GPU_CASES", " ".join(CASES)).split()
    if _num_gpus() < 2:  # the TP cases are then skipped (``_need``)
        names = [n for n in names if CASES[n].get("tp", 1) == 1]
    if os.environ.get("R3_GPU_REPLAY") == "1":
        # Judge a finished device run's saved results again (no engines).
        return {name: _load(name) for name in names}
    t0 = time.time()
    runs: dict[str, Run] = {}
    pending = []
    for name in names:
        p = _launch(name, CASES[name])
        if serial:
            _wait(p, name)
        pending.append((name, p))
    for name, p in pending:
        _wait(p, name)
    for name in names:
        runs[name] = _load(name)
    # An engine that failed next to the others gets one serial retry, so a
    # failure is never an artefact of running them concurrently.
    failed = [n for n in names if not runs[n].meta.get("ok")]
    for name in failed:
        if time.time() - t0 > RETRY_BUDGET_S:
            break
        (OUT / f"{name}.log").rename(OUT / f"{name}.parallel.log")
        p = _launch(name, CASES[name])
        _wait(p, name)
        runs[name] = _load(name)
        runs[name].meta["retried_serially"] = True
    summary = {
        n: {
            k: r.meta.get(k)
            for k in (
                "ok",
                "wall_s",
                "init_s",
                "runner",
                "attn_backend",
                "use_v2_model_runner",
                "async_scheduling",
                "chunked_prefill",
                "max_num_batched_tokens",
                "speculative",
                "shm_root_left",
                "shim_ops_missing",
                "error",
                "retried_serially",
            )
        }
        for n, r in runs.items()
    }
    summary["_wall_s"] = round(time.time() - t0, 1)
    (OUT / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print("ENGINES " + json.dumps(summary, default=str), flush=True)
    return runs


def _num_gpus() -> int:
    if os.environ.get("R3_GPU_REPLAY") == "1":
        return 2
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def _wait(p: subprocess.Popen, name: str) -> None:
    try:
        p.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        with open(OUT / f"{name}.log", "a") as f:
            f.write(f"\n[test_r3_gpu] killed after {TIMEOUT_S}s\n")


def _need(runs: dict[str, Run], name: str) -> Run:
    if name not in runs:
        _skip(f"case {name} not run")
    r = runs[name]
    assert r.meta.get("ok"), (
        f"engine {name} failed: {r.meta.get('error')}\n"
        f"{r.meta.get('traceback', '')}\n--- log tail ---\n{r.log[-4000:]}"
    )
    return r


def _ran(runs: dict[str, Run], names, what: str) -> list[str]:
    """The cases of ``names`` that ran; none is a skip naming ``what`` (a
    test over absent cases checks nothing, so it may not pass)."""
    ran = [n for n in names if n in runs]
    if not ran:
        _skip(f"no {what} case in this run's case set (R3_GPU_CASES)")
    return ran


def _skip(msg: str):
    if pytest is not None:
        pytest.skip(msg)
    raise _Skip(msg)


class _Skip(Exception):
    pass


if pytest is not None:

    @pytest.fixture(scope="module")
    def runs():
        return collect_runs()


# ----------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------


def test_engines_ran_on_model_runner_v2(runs):
    for name in _ran(runs, CASES, "engine"):
        r = _need(runs, name)
        m = r.meta
        assert m["use_v2_model_runner"] is True, (name, m["use_v2_model_runner"])
        assert all("v1.worker.gpu.model_runner" in x for x in m["runner"]), (
            name,
            m["runner"],
        )
        assert "TRITON" in str(m.get("attn_backend")).upper() or (
            "TRITON_ATTN" in r.log
        ), (name, m.get("attn_backend"))
        want_async = CASES[name].get("expect_async", CASES[name]["async"])
        assert m["async_scheduling"] is (True if want_async is None else want_async), (
            name,
            m["async_scheduling"],
        )
        assert (m.get("speculative") or None) == CASES[name].get("speculative"), name
        assert m["max_num_batched_tokens"] == CASES[name]["max_batched"]
        assert m["tensor_parallel_size"] == CASES[name].get("tp", 1), name
        assert m["tree_has_artifact_config"] is (CASES[name]["tree"] == "fork"), name
        assert m.get("TRITON_F32_DEFAULT") == CASES[name].get("f32"), name
        want_rounds = CASES[name].get("rounds", [ROUND1, ROUND2])
        assert len(m["rounds"]) == len(want_rounds), name
        for rnd, idx in zip(m["rounds"], want_rounds):
            assert [d["prompt"] for d in rnd["outs"]] == idx, name
            n = rnd.get("max_tokens", 16)
            for d in rnd["outs"]:
                assert d["prompt_ok"] and len(d["token_ids"]) == n, (name, d)


def test_router_ran_as_vllm_kernel_where_staged(runs):
    """Where the wheel's stable-ABI ``_moe_C`` library was staged
    (tests/gpu/stage_kernels.py), every engine routed through vLLM's own
    ``topk_softmax`` kernel, never the stand-in; without it, a skip saying
    why (the stand-ins serve)."""
    checked = []
    for name in _ran(runs, CASES, "engine"):
        shim = _need(runs, name).meta.get("shim")
        if not shim or shim["libraries"].get(MOE_LIBRARY) != "loaded":
            continue
        assert "_moe_C.topk_softmax" in shim["kernel_ops"], (name, shim)
        assert "_moe_C.topk_softmax" in shim["called_kernels"], (name, shim)
        assert "_moe_C.topk_softmax" not in shim["called_stand_ins"], (name, shim)
        checked.append(name)
    if not checked:
        _skip(f"{MOE_LIBRARY} not staged on this machine: the stand-ins served")
    _record("cases routed by vLLM's topk_softmax", {"cases": checked})


def test_shape_dtype_and_no_error(runs):
    # Every fork case that ran (the TP cases do not on one GPU); none at all
    # is a skip.
    for name in _ran(runs, FORK_CASES, "fork"):
        r = _need(runs, name)
        L, K, E = r.meta["num_hidden_layers"], r.meta["top_k"], r.meta["num_experts"]
        assert r.meta.get("shm_root_left") is False, (name, "store left in /dev/shm")
        for rnd in range(len(r.meta["rounds"])):
            for i, d in r.outs(rnd).items():
                assert d["routed_experts_error"] is None, (name, rnd, i, d)
                re = r.routes.get((rnd, i))
                assert re is not None, (name, rnd, i, "no routed_experts")
                n = d["prompt_len"] + len(d["token_ids"]) - 1
                assert re.shape == (n, L, K), (name, rnd, i, re.shape, (n, L, K))
                assert re.dtype == np.uint8, (name, re.dtype)
                assert int(re.max()) < E
                # k distinct experts per token and layer; not a zero fill
                srt = np.sort(re.astype(np.int32), axis=-1)
                assert (np.diff(srt, axis=-1) > 0).all(), (
                    name,
                    rnd,
                    i,
                    "repeated expert",
                )
                assert len(np.unique(re)) > K, (name, rnd, i, "degenerate routes")


# ---------------------------------------------------------------- comparisons
_COMPARISONS: dict[str, dict] = {}
_HF: dict = {}


def _hf_logits(ids: list[int]) -> np.ndarray | None:
    """transformers' router logits [T, L, E] in float32 on the CPU, or None
    without transformers."""
    key = tuple(ids)
    if key not in _HF:
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError:
            return None
        if "model" not in _HF:
            _HF["model"] = AutoModelForCausalLM.from_pretrained(
                str(MODEL), dtype=torch.float32
            ).eval()
        with torch.no_grad():
            out = _HF["model"](torch.tensor([list(ids)]), output_router_logits=True)
        t = len(ids)
        _HF[key] = torch.stack(
            [x.reshape(t, -1).float() for x in out.router_logits], dim=1
        ).numpy()
    return _HF[key]


def _compare(
    what: str,
    a: np.ndarray,
    b: np.ndarray,
    ids: list[int] | None,
    tol: tuple[float, float] | None,
) -> dict:
    """Entries where ``a`` and ``b`` differ: each must exchange experts whose
    router logits (transformers, for ``ids``) lie within ``tol`` (``None``:
    no difference allowed), and they must be rare. Returns counts."""
    a = a.astype(np.int64)
    b = b.astype(np.int64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    bad = np.argwhere(a != b)
    rep = {
        "entries": int(a.size),
        "mismatch": int(len(bad)),
        "tokens_layers": int(len({(int(t), int(ly)) for t, ly, _ in bad})),
        "max_gap": 0.0,
    }
    if len(bad):
        rep["first"] = bad[:4].tolist()
    if len(bad):
        assert tol is not None, (what, rep)
        logits = _hf_logits(ids) if ids is not None else None
        assert logits is not None, (what, "differs and no oracle to call it a tie", rep)
        assert logits.shape[:2] == a.shape[:2], (what, logits.shape, a.shape)
        gaps = [
            abs(float(logits[t, ly, a[t, ly, k]] - logits[t, ly, b[t, ly, k]]))
            for t, ly, k in bad
        ]
        rep["max_gap"] = max(gaps)
        max_gap, max_share = tol
        assert rep["max_gap"] < max_gap, (what, "not a near-tie", rep)
        assert len(bad) <= max_share * a.size + 2, (what, "too many ties", rep)
    return rep


def _record(key: str, rep: dict) -> None:
    _COMPARISONS[key] = rep
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "comparisons.json").write_text(json.dumps(_COMPARISONS, indent=1))


def _ids(r: Run, rnd: int, i: int) -> list[int]:
    d = r.outs(rnd)[i]
    return (_prompt_ids(i) + d["token_ids"])[:-1]


def _assert_replayed(r: Run, name: str, i: int, cached: int) -> None:
    """Rows of round 2's prompt ``i`` below ``cached`` came from the store:
    each block of them is, bit for bit, that block of a round-1 request with
    the same tokens up to it (whichever request published it)."""
    bs = r.meta["block_size"]
    got = r.routes[(1, i)]
    ids = _prompt_ids(i)
    for b in range(cached // bs):
        lo, hi = b * bs, (b + 1) * bs
        sources = [j for j in ROUND1 if _prompt_ids(j)[:hi] == ids[:hi]]
        assert any(
            np.array_equal(got[lo:hi], r.routes[(0, j)][lo:hi]) for j in sources
        ), (
            name,
            "round 2 prompt",
            i,
            "block",
            b,
            "replayed rows match no round-1 request with these tokens",
            sources,
        )


def test_prefix_cache_round_identical(runs):
    """Round 2 repeats round 1's prompts: prefix-cache hits. The cached rows
    are replayed from the store (bit for bit); the whole array equals round
    1's up to near-ties (exactly, when round 1 computed the shared prefix
    identically for every prompt)."""
    for name in _ran(runs, CASES, "engine"):
        r = _need(runs, name)
        tol = TIE_TOL[CASES[name].get("f32")]
        o1, o2 = r.outs(0), r.outs(1)
        total = {"entries": 0, "mismatch": 0, "max_gap": 0.0, "cached_tokens": {}}
        for i in ROUND2:
            cached = o2[i]["num_cached_tokens"]
            total["cached_tokens"][i] = cached
            assert cached >= PREFIX_LEN, (name, i, o2[i])
            _assert_replayed(r, name, i, cached)
            if i not in ROUND1:  # new prompt, cached prefix
                continue
            assert o1[i]["token_ids"] == o2[i]["token_ids"], (name, i)
            rep = _compare(
                f"{name} round 2 vs 1, prompt {i}",
                r.routes[(0, i)],
                r.routes[(1, i)],
                _ids(r, 0, i),
                tol,
            )
            for k in ("entries", "mismatch"):
                total[k] += rep[k]
            total["max_gap"] = max(total["max_gap"], rep["max_gap"])
        _record(f"{name}: round 2 vs round 1", total)


def test_shared_prefix_rows_equal(runs):
    """Every prompt starts with the same 256 tokens, computed once per prompt
    in round 1 (equal up to near-ties; exactly, so far) and served from the
    cache in round 2 (checked bit for bit above)."""
    for name in _ran(runs, CASES, "engine"):
        r = _need(runs, name)
        tol = TIE_TOL[CASES[name].get("f32")]
        ref = r.routes[(0, ROUND1[0])][:PREFIX_LEN]
        ids = _prompt_ids(ROUND1[0])[:PREFIX_LEN]
        total = {"entries": 0, "mismatch": 0, "max_gap": 0.0}
        for (rnd, i), re in sorted(r.routes.items()):
            rep = _compare(
                f"{name} prefix rows, round {rnd + 1} prompt {i}",
                re[:PREFIX_LEN],
                ref,
                ids,
                tol,
            )
            for k in ("entries", "mismatch"):
                total[k] += rep[k]
            total["max_gap"] = max(total["max_gap"], rep["max_gap"])
        _record(f"{name}: shared prefix rows", total)


def _assert_same(
    a: Run,
    b: Run,
    what: str,
    tol: tuple[float, float] | None,
    rounds: tuple[int, ...] = (0, 1),
) -> dict:
    total = {"entries": 0, "mismatch": 0, "tokens_layers": 0, "max_gap": 0.0}
    for rnd in rounds:
        oa, ob = a.outs(rnd), b.outs(rnd)
        assert oa.keys() == ob.keys()
        for i in oa:
            assert oa[i]["token_ids"] == ob[i]["token_ids"], (what, rnd, i)
            rep = _compare(
                f"{what}, round {rnd + 1} prompt {i}",
                a.routes[(rnd, i)],
                b.routes[(rnd, i)],
                _ids(a, rnd, i),
                tol,
            )
            for k in ("entries", "mismatch", "tokens_layers"):
                total[k] += rep[k]
            total["max_gap"] = max(total["max_gap"], rep["max_gap"])
            if rep["mismatch"]:
                total.setdefault("where", []).append(
                    {
                        "round": rnd + 1,
                        "prompt": i,
                        "n": rep["mismatch"],
                        "first": rep["first"],
                    }
                )
    _record(what, total)
    return total


def test_chunked_prefill_same_routes(runs):
    ref = _need(runs, "ref")
    chunked = _need(runs, "chunked")
    assert (
        chunked.meta["chunked_prefill"] and chunked.meta["max_num_batched_tokens"] == 64
    )
    assert min(d["prompt_len"] for d in chunked.outs(0).values()) > 64
    _assert_same(ref, chunked, "chunked (64) vs unchunked", TIE_TOL[None])


def test_chunked_prefill_same_routes_ieee(runs):
    _assert_same(
        _need(runs, "ref_ieee"),
        _need(runs, "chunked_ieee"),
        "IEEE fp32: chunked (64) vs unchunked",
        TIE_TOL["ieee"],
    )


def test_async_scheduling_off_same_routes(runs):
    _assert_same(
        _need(runs, "ref"), _need(runs, "sync"), "async off vs on", TIE_TOL[None]
    )


def test_sync_chunked_same_routes(runs):
    _assert_same(
        _need(runs, "ref"),
        _need(runs, "sync_chunked"),
        "async off + chunked vs ref",
        TIE_TOL[None],
    )


def test_same_routes_as_base_aux_output(runs):
    """The pristine tree's own R3 (AuxOutput) for the same weights, prompts
    and kernels: identical tokens and routes, bit for bit (its dtype may
    differ)."""
    base = _need(runs, "base")
    for rnd in base.meta["rounds"]:
        for d in rnd["outs"]:
            assert d["shape"] is not None, ("base returned no routes", d)
    rep = _assert_same(_need(runs, "ref"), base, "fork vs base AuxOutput", None)
    rep["base_dtype"] = base.meta["rounds"][0]["outs"][0]["dtype"]
    _record("fork vs base AuxOutput", rep)


def _oracle(runs, name: str, tol: tuple[float, float]) -> None:
    r = _need(runs, name)
    if _hf_logits([3, 4]) is None:
        _skip("transformers not importable")
    import transformers

    total = {
        "transformers": transformers.__version__,
        "entries": 0,
        "mismatch": 0,
        "tokens_layers": 0,
        "max_gap": 0.0,
        "set_mismatch_tokens_layers": 0,
    }
    for (rnd, i), got in sorted(r.routes.items()):
        ids = _ids(r, rnd, i)
        logits = _hf_logits(ids)
        k = got.shape[-1]
        want = np.argsort(-logits, axis=-1, kind="stable")[..., :k]
        same_set = (np.sort(got.astype(np.int64), -1) == np.sort(want, -1)).all(-1)
        total["set_mismatch_tokens_layers"] += int((~same_set).sum())
        rep = _compare(
            f"{name} vs transformers, round {rnd + 1} prompt {i}", got, want, ids, tol
        )
        for key in ("entries", "mismatch", "tokens_layers"):
            total[key] += rep[key]
        total["max_gap"] = max(total["max_gap"], rep["max_gap"])
    _record(f"{name} vs transformers router", total)
    print("ORACLE " + json.dumps(total), flush=True)


def test_matches_transformers_router(runs):
    """Independent oracle: transformers' router top-k (float32, CPU) for
    prompt + output minus the last token (tests/utils/oracle.py's contract)."""
    _oracle(runs, "ref", TIE_TOL[None])


def test_matches_transformers_router_ieee(runs):
    _oracle(runs, "ref_ieee", TIE_TOL["ieee"])


# ------------------------------------------------------------- CUDA graphs
GRAPH_CASES = [
    c for c, s in CASES.items() if "compilation_config" in s.get("override", {})
]


def test_cuda_graphs_captured_and_replayed(runs):
    """The graph cases decoded through replays of captured full graphs (a
    fall-back to eager would make every other graph test vacuous); the
    eager ones never replayed."""
    _ran(runs, GRAPH_CASES, "CUDA-graph")
    ran = [n for n in runs if CASES[n].get("tp", 1) == 1]
    for name in ran:
        r = _need(runs, name)
        (graphs,) = r.meta["cudagraphs"]
        if name in GRAPH_CASES:
            assert "FULL" in r.meta["cudagraph_mode"], (name, r.meta["cudagraph_mode"])
            assert graphs["captured"], (name, graphs)
            decode_steps = sum(rnd["max_tokens"] - 1 for rnd in r.meta["rounds"])
            assert graphs["replays"] >= decode_steps, (name, graphs, decode_steps)
        else:
            assert graphs is None or graphs["replays"] == 0, (name, graphs)


def test_cuda_graphs_same_routes_as_eager(runs):
    """Decode steps replayed from graphs run the same kernels on padded
    batches: routes equal the eager run's up to near-ties, tokens equal."""
    _assert_same(
        _need(runs, "ref"), _need(runs, "graphs"), "CUDA graphs vs eager", TIE_TOL[None]
    )


def test_cuda_graphs_same_routes_as_eager_ieee(runs):
    _assert_same(
        _need(runs, "ref_ieee"),
        _need(runs, "graphs_ieee"),
        "IEEE fp32: CUDA graphs vs eager",
        TIE_TOL["ieee"],
    )


def test_cuda_graphs_same_routes_as_base_aux_output(runs):
    """Under graphs, the fork against the pristine tree's AuxOutput R3 in
    the same mode: bit for bit."""
    _assert_same(
        _need(runs, "graphs"),
        _need(runs, "base_graphs"),
        "CUDA graphs: fork vs base AuxOutput",
        None,
    )


def test_cuda_graphs_match_transformers_router(runs):
    """Rows captured inside replayed graphs are this step's (a capture that
    missed the replay would hand back the capture-time rows: stale)."""
    _oracle(runs, "graphs", TIE_TOL[None])


def test_cuda_graphs_match_transformers_router_ieee(runs):
    _oracle(runs, "graphs_ieee", TIE_TOL["ieee"])


# ------------------------------------------------------- tensor parallelism


def test_tp2_same_routes_as_tp1(runs):
    """TP=2 splits every matmul across two GPUs and sums partial results in
    another order, so computed routes may differ from TP=1 only at
    near-ties (the same rule as for other batch shapes); tokens are equal."""
    for name, ref in TP_REF.items():
        tol = TIE_TOL[CASES[name].get("f32")]
        _assert_same(_need(runs, ref), _need(runs, name), f"TP=2 vs TP=1: {name}", tol)


def test_tp2_every_rank_captures_only_rank_0_publishes(runs):
    for name in TP_REF:
        r = _need(runs, name)
        m = r.meta
        assert m["probe"]["error"] is None and r.probe is not None, (name, m["probe"])
        ranks = sorted(m["ranks"], key=lambda f: f["global_rank"])
        assert [(f["global_rank"], f["tp_rank"]) for f in ranks] == [(0, 0), (1, 1)]
        # Both ranks' capture buffers hold the probe's last route.
        last = r.probe[-1].astype(np.int64).tolist()
        for f in ranks:
            assert f["capture_row0"] == last, (name, f)
        assert ranks[0]["publishes"] and ranks[0]["store_files_in_use"], name
        assert not ranks[1]["publishes"], name
        assert ranks[1]["store_files_in_use"] == [], (name, ranks[1])
        assert m["store_entries"] == [m["namespace_rank0"]], name


def test_tp2_matches_transformers_router_ieee(runs):
    _oracle(runs, "tp2_ieee", TIE_TOL["ieee"])


# --------------------------------------------------- expert load balancing
# EPLB case -> the case without EPLB it must equal
EPLB_REF = {
    "eplb": "ref",
    "eplb_async": "ref",
    "eplb_graphs": "graphs",
    "tp2_eplb": "ref",
}


def test_eplb_routes_logical_and_same_as_without(runs):
    """With redundant experts the router's logical IDs are mapped to physical
    replicas (base_router.py, ``_apply_eplb_mapping``) after the capture
    hook has seen them: the returned routes are logical IDs, equal to the
    run without EPLB up to near-ties, before the first rebalancing (round 1)
    and after (rounds 2 and 3); the tokens are equal, so the experts'
    weights moved with the map."""
    names = _ran(runs, EPLB_REF, "EPLB")
    report = {}
    for name in names:
        r = _need(runs, name)
        ref = _need(runs, EPLB_REF[name])
        m = r.meta
        assert m["enable_eplb"] is True, name
        n_log = m["num_experts"]
        n_phys = n_log + CASES[name]["eplb"]["num_redundant_experts"]
        # m["eplb"]: before round 1, then after each round; one entry per rank
        log = m["eplb"]
        assert len(log) == len(m["rounds"]) + 1, (name, len(log))
        for facts in log:
            assert len({json.dumps(f, sort_keys=True) for f in facts}) == 1, (
                name,
                "ranks disagree on the placement",
                facts,
            )
        facts = [x[0] for x in log]
        p2l = [f["physical_to_logical"] for f in facts]
        assert all(len(row) == n_phys for row in p2l[0]), (name, p2l[0])
        assert facts[0]["is_async"] is CASES[name]["eplb"]["use_async"], name
        assert facts[1]["rearranges"] == 0, (name, "rebalanced in round 1", facts[1])
        assert facts[-1]["rearranges"] >= 1, (name, "never rebalanced", facts[-1])
        assert p2l[-1] != p2l[0], (name, "placement unchanged", p2l[0])
        per_round = {}
        for rnd in range(len(m["rounds"])):
            for i in r.outs(rnd):
                got = int(r.routes[(rnd, i)].max())
                assert got < n_log, (name, rnd, i, "physical IDs returned", got)
            rep = _assert_same(
                ref,
                r,
                f"EPLB {name} vs off, round {rnd + 1}",
                TIE_TOL[None],
                rounds=(rnd,),
            )
            per_round[rnd + 1] = {
                "rearranges_before": facts[rnd]["rearranges"],
                "rearranges_after": facts[rnd + 1]["rearranges"],
                "placement_changed_in_round": p2l[rnd + 1] != p2l[rnd],
                "mismatch": rep["mismatch"],
                "entries": rep["entries"],
                "max_gap": rep["max_gap"],
            }
        report[name] = {
            "physical_experts": n_phys,
            "initial_map_layer0": p2l[0][0],
            "final_map_layer0": p2l[-1][0],
            "final_replicas_layer0": facts[-1]["replica_count"][0],
            "rounds": per_round,
        }
    _record("EPLB placement and routes", report)
    print("EPLB " + json.dumps(report), flush=True)


# ------------------------------------------------------- speculative decoding


def _common_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _assert_same_over_common_tokens(
    ref: Run, spec: Run, what: str, tol: tuple[float, float]
) -> dict:
    """``spec``'s routes equal ``ref``'s (no speculation) for every prompt of
    every round, over the rows whose input tokens are the same in both: the
    prompt and the generated tokens up to the first that differs (greedy;
    they differ only after a near-tie). Up to near-ties (``tol``)."""
    total = {
        "entries": 0,
        "mismatch": 0,
        "tokens_layers": 0,
        "max_gap": 0.0,
        "generated_rows": 0,
        "generated_rows_compared": 0,
        "prompts": 0,
        "prompts_diverged": [],
    }
    assert len(spec.meta["rounds"]) == len(ref.meta["rounds"]), what
    for rnd in range(len(spec.meta["rounds"])):
        oa, ob = ref.outs(rnd), spec.outs(rnd)
        assert oa.keys() == ob.keys(), (what, rnd)
        for i in ob:
            ta, tb = oa[i]["token_ids"], ob[i]["token_ids"]
            c = _common_len(ta, tb)
            plen = ob[i]["prompt_len"]
            a, b = ref.routes[(rnd, i)], spec.routes[(rnd, i)]
            # Row t is the route of input token t: rows below plen + c have
            # the same tokens up to and including their own in both runs.
            n = min(plen + c, len(a), len(b))
            ids = (_prompt_ids(i) + tb)[:n]
            rep = _compare(
                f"{what}, round {rnd + 1} prompt {i} ({c} common tokens)",
                a[:n],
                b[:n],
                ids,
                tol,
            )
            for k in ("entries", "mismatch", "tokens_layers"):
                total[k] += rep[k]
            total["max_gap"] = max(total["max_gap"], rep["max_gap"])
            # rows of generated tokens: plen .. plen + len(tb) - 2
            total["generated_rows"] += len(tb) - 1
            total["generated_rows_compared"] += max(0, n - plen)
            total["prompts"] += 1
            if c < len(tb):
                total["prompts_diverged"].append(
                    {"round": rnd + 1, "prompt": i, "common_tokens": c}
                )
            if rep["mismatch"]:
                total.setdefault("where", []).append(
                    {"round": rnd + 1, "prompt": i, "n": rep["mismatch"]}
                )
    # Greedy speculation must reproduce the tokens but for rare near-ties:
    # most generated rows get compared.
    assert total["generated_rows_compared"] >= total["generated_rows"] // 2, (
        what,
        total,
    )
    _record(what, total)
    print("SPEC_VS_REF " + json.dumps({what: total}), flush=True)
    return total


def _spec_case(runs, name: str) -> Run:
    r = _need(runs, name)
    want = CASES[name]["speculative"]
    assert r.meta.get("speculative") == want, (name, r.meta.get("speculative"))
    assert all(
        s is not None and s.endswith("NgramGPUSpeculator") for s in r.meta["speculator"]
    ), (name, r.meta["speculator"])
    return r


def test_spec_decode_same_routes_as_ref(runs):
    for name in _ran(runs, ("spec", "spec_sync"), "speculative"):
        _assert_same_over_common_tokens(
            _need(runs, SPEC_REF[name]),
            _spec_case(runs, name),
            f"{name} ({CASES[name]['speculative']['method']}) vs ref",
            TIE_TOL[None],
        )


def test_spec_decode_same_routes_as_ref_ieee(runs):
    _assert_same_over_common_tokens(
        _need(runs, "ref_ieee"),
        _spec_case(runs, "spec_ieee"),
        "IEEE fp32: spec (ngram_gpu) vs ref_ieee",
        TIE_TOL["ieee"],
    )


def test_spec_decode_drafts_accepted_and_rejected(runs):
    """The acceptance metrics of every request (``detailed``): drafts were
    proposed, some accepted, some rejected, and some verify steps kept part
    of their drafts only (rows dropped from the middle of a step)."""
    names = _ran(runs, SPEC_REF, "speculative")
    report = {}
    for name in names:
        r = _spec_case(runs, name)
        tot = {"requests": 0, "num_draft_tokens": 0, "accepted": 0, "rejected": 0}
        steps = {"steps": 0, "all_accepted": 0, "partial": 0, "none_accepted": 0}
        per_round = []
        for rnd in r.meta["rounds"]:
            acc = drafts = 0
            for d in rnd["outs"]:
                m = d.get("spec_decode")
                assert m is not None, (name, d["prompt"], "no spec_decode_metrics")
                tot["requests"] += 1
                for k in ("num_draft_tokens", "accepted", "rejected"):
                    tot[k] += m[k]
                acc += m["accepted"]
                drafts += m["num_draft_tokens"]
                for a, p in zip(m["per_step_accepted"], m["per_step_drafted"]):
                    steps["steps"] += 1
                    if a == p:
                        steps["all_accepted"] += 1
                    elif a == 0:
                        steps["none_accepted"] += 1
                    else:
                        steps["partial"] += 1
            per_round.append({"drafts": drafts, "accepted": acc})
        tot["acceptance_rate"] = round(
            tot["accepted"] / max(1, tot["num_draft_tokens"]), 3
        )
        tot["verify_steps"] = steps
        tot["per_round"] = per_round
        if "ngram_async_probe" in r.meta:
            tot["ngram_async_probe"] = r.meta["ngram_async_probe"]
        report[name] = tot
        assert tot["num_draft_tokens"] > 0, (name, tot)
        assert tot["accepted"] > 0 and tot["rejected"] > 0, (name, tot)
        assert steps["partial"] > 0, (name, tot)
    _record("speculative acceptance", report)
    print("SPEC_ACCEPTANCE " + json.dumps(report), flush=True)


def test_spec_decode_matches_transformers_router(runs):
    for name in _ran(runs, ("spec", "spec_sync"), "speculative"):
        _spec_case(runs, name)
        _oracle(runs, name, TIE_TOL[None])


def test_spec_decode_matches_transformers_router_ieee(runs):
    _spec_case(runs, "spec_ieee")
    _oracle(runs, "spec_ieee", TIE_TOL["ieee"])


def test_routes_by_reference_fetch_equal_inline(runs):
    """The engine hands the routes out with routed_experts_format="ref"; a
    separate trainer process on the GPU node (no vLLM, no torch) fetches
    them, bit for bit equal to the inline routes of the same requests."""
    r = _need(runs, "handoff")
    h = r.meta["by_ref"]
    assert h["errors"] == {}, h
    assert h["trainer_rc"] == 0, h["trainer_stderr"]
    assert h["imported"] == [], h["imported"]
    assert set(h["equal"]) == {str(i) for i in ROUND1}, h
    assert all(h["equal"].values()), h["equal"]
    assert all(v["transport"] == "host" for v in h["refs"].values())
    _record("handoff_fetch_s", {"seconds": h["seconds"], "refs": h["refs"]})


def _prompt_ids(i: int) -> list[int]:
    from r3_engine import prompts

    return prompts()[i]


# ----------------------------------------------------------------------------
# Script mode (no pytest on the machine)
# ----------------------------------------------------------------------------

if __name__ == "__main__":
    import traceback

    all_runs = collect_runs()
    tests = [v for k, v in list(globals().items()) if k.startswith("test_")]
    failed = 0
    for fn in tests:
        try:
            fn(all_runs)
            print(f"PASS {fn.__name__}", flush=True)
        except _Skip as e:
            print(f"SKIP {fn.__name__}: {e}", flush=True)
        except Exception:  # noqa: BLE001
            failed += 1
            print(f"FAIL {fn.__name__}\n{traceback.format_exc()[-3000:]}", flush=True)
    print(f"{len(tests) - failed}/{len(tests)} passed", flush=True)
    sys.exit(1 if failed else 0)
