# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One offline engine run for the GPU R3 tests, in its own process.

    python3 tests/gpu/r3_engine.py SPEC_JSON OUT_PREFIX

SPEC_JSON (a JSON string) names the tree (``fork``: the Artifact Connector,
``enable_routed_experts``; ``base``: the pristine 0.32.0 tree's AuxOutput R3,
``enable_return_routed_experts``), the model directory, the scheduling knobs,
the rounds of prompts (indices into :func:`prompts`) with the new tokens of
each (``round_max_tokens``), and optionally a ``speculative`` config (then
per-request acceptance metrics are recorded per output, and with
``probe_ngram_async`` whether the config accepts ``method="ngram"`` with
async scheduling on). Writes
``OUT_PREFIX.json`` (token IDs, cached tokens, errors, dtypes, engine facts)
and ``OUT_PREFIX.npz`` (``r{round}_p{prompt}``: the returned routes) and prints
``RESULT <json summary>``. Which ``vllm`` is imported is up to PYTHONPATH.

With ``tp`` > 1 (tensor parallelism), a last request alone (``probe``: 4 new
tokens) ends the run, and each rank's part in R3 is recorded
(tests/utils/tp.py's ``rank_facts``: whether it publishes, the store files it
holds, its capture buffer's first row, which is then the probe's last route)
with the store root's entries.

With ``by_ref``, a last round asks for the first round's prompts again by
reference (``routed_experts_format="ref"``) and a separate trainer process
(``fetch_refs.py``: no vLLM, no torch) fetches them while the engine runs;
``by_ref`` records, per prompt, whether the fetched array equals the first
round's inline one, each fetch's time and what the trainer imported.

With ``eplb`` (EPLBConfig fields), expert load balancing is on with
expert parallelism; at one GPU (TP = DP = 1, which 0.32.0's config refuses
for EPLB) it is switched on after the config has been validated
(:func:`_force_eplb`). The test hook then resets the rearrangement counter
(rebalancing at ``step_interval`` steps from the first round on) and the
run records, before the first round and after each, how many rearrangements
ran and the physical-to-logical expert map (``eplb``).

Prompts are token IDs (the engine is started with ``skip_tokenizer_init``):
a shared prefix of :data:`PREFIX_LEN` tokens and suffixes of different
lengths, all drawn from a fixed seed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from utils.tp import rank_facts  # noqa: E402

PREFIX_LEN = 256  # 16 blocks of 16 tokens
ROUND1 = [0, 1, 2, 3, 4, 5]
ROUND2 = [0, 1, 2, 3, 4, 5, 6, 7]  # the same prompts again, and two new ones
SUFFIX_LENS = [30, 100, 200, 300, 17, 340, 50, 5]


# Prompts with repetition, for speculative decoding (indices 8..11): the shared
# prefix, then a short pattern repeated (period, repeats), or (period 0) a
# stretch of the prefix copied (n-gram drafts from the prefix).
REPEATS = [(4, 16), (7, 10), (0, 64), (1, 24)]
ROUND_REP = [8, 9, 10, 11]


def prompts(vocab: int = 512, first_id: int = 3) -> list[list[int]]:
    """Deterministic token-ID prompts sharing a prefix (IDs avoid the special
    tokens 0..first_id-1): :data:`SUFFIX_LENS` random suffixes (indices 0..7),
    then the repetitive ones of :data:`REPEATS` (8..11)."""
    rng = np.random.RandomState(20261130)
    prefix = rng.randint(first_id, vocab, size=PREFIX_LEN).tolist()
    out = [prefix + rng.randint(first_id, vocab, size=n).tolist() for n in SUFFIX_LENS]
    for period, reps in REPEATS:
        if period:
            pattern = rng.randint(first_id, vocab, size=period).tolist()
            out.append(prefix + pattern * reps)
        else:
            out.append(prefix + prefix[100 : 100 + reps])
    return out


def _runner_name(worker) -> str:
    mr = worker.model_runner
    return f"{type(mr).__module__}.{type(mr).__qualname__}"


def _speculator_name(worker) -> str | None:
    sp = getattr(worker.model_runner, "speculator", None)
    return None if sp is None else f"{type(sp).__module__}.{type(sp).__qualname__}"


def _attn_backend(worker) -> list[str]:
    ctx = worker.model_runner.vllm_config.compilation_config.static_forward_context
    names = set()
    for layer in ctx.values():
        b = getattr(layer, "attn_backend", None)
        if b is not None:
            names.add(getattr(b, "__name__", type(b).__name__))
    return sorted(names)


def _graph_replays(worker) -> dict | None:
    """Model Runner V2's full CUDA graphs: the token counts captured and how
    many replays ran (the first call installs the counter)."""
    cgm = getattr(worker.model_runner, "cudagraph_manager", None)
    if cgm is None:
        return None
    if not hasattr(cgm, "r3_test_replays"):
        orig = cgm.run_fullgraph
        cgm.r3_test_replays = 0

        def run_fullgraph(desc, _orig=orig, _cgm=cgm):
            _cgm.r3_test_replays += 1
            return _orig(desc)

        cgm.run_fullgraph = run_fullgraph
    return {"captured": cgm.captured_token_counts(), "replays": cgm.r3_test_replays}


def _force_eplb(eplb: dict) -> None:
    """EPLB on one GPU. 0.32.0's ParallelConfig refuses ``enable_eplb``
    unless TP, PCP or DP > 1 (config/parallel.py, _validate_parallel_config),
    yet nothing after it needs a second rank: set it (and the redundant
    experts) on the validated config, before the model is built. The
    communicator must be named: ParallelConfig.__post_init__ picks it only
    with ``enable_eplb`` already set."""
    from vllm.config.parallel import EPLBConfig
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        cfg = orig(self, *args, **kwargs)
        pc = cfg.parallel_config
        pc.enable_eplb = True
        pc.eplb_config = EPLBConfig(**eplb)
        return cfg

    EngineArgs.create_engine_config = create_engine_config


def _eplb_facts(worker, reset_step: bool = False) -> dict | None:
    """The EPLB state of this rank: rearrangements counted since the first
    call (which installs the counter, and with ``reset_step`` restarts the
    rearrangement interval), the physical-to-logical map ``[layers,
    physical]`` and the replica counts ``[layers, logical]``."""
    st = getattr(worker.model_runner, "eplb_state", None)
    if st is None:
        return None
    if not hasattr(st, "r3_test_rearranges"):
        orig = st.rearrange
        st.r3_test_rearranges = 0

        def rearrange(*args, _orig=orig, _st=st, **kwargs):
            if not kwargs.get("is_profile", args[0] if args else False):
                _st.r3_test_rearranges += 1
            return _orig(*args, **kwargs)

        st.rearrange = rearrange
        if reset_step:
            st.expert_rearrangement_step = 0
    (ms,) = st.model_states.values()
    return {
        "rearranges": st.r3_test_rearranges,
        "step": st.expert_rearrangement_step,
        "interval": st.expert_rearrangement_step_interval,
        "is_async": st.is_async,
        "physical_to_logical": ms.physical_to_logical_map.cpu().tolist(),
        "replica_count": ms.logical_replica_count.cpu().tolist(),
    }


def _eplb_facts_reset(worker) -> dict | None:
    return _eplb_facts(worker, reset_step=True)


def run(spec: dict, out_prefix: str) -> dict:
    import torch

    from vllm import LLM, SamplingParams

    tree = spec["tree"]
    shm_root = None
    kw = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=True,
        attention_backend="TRITON_ATTN",
        moe_backend="triton",
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=int(spec.get("max_batched", 4096)),
        kv_cache_memory_bytes=1 << 30,
        gpu_memory_utilization=float(spec.get("gpu_mem", 0.15)),
        seed=0,
    )
    if int(spec.get("max_batched", 4096)) < kw["max_model_len"]:
        kw["enable_chunked_prefill"] = True
    if spec.get("async") is not None:
        kw["async_scheduling"] = bool(spec["async"])
    tp = int(spec.get("tp", 1))
    if tp > 1:
        kw["tensor_parallel_size"] = tp
        kw["disable_custom_all_reduce"] = True  # no custom all-reduce kernel here
    eplb = spec.get("eplb")
    if eplb:
        kw["enable_expert_parallel"] = True
        if tp > 1:
            kw["enable_eplb"] = True
            kw["eplb_config"] = dict(eplb)
        else:
            _force_eplb(eplb)
    if tree == "fork":
        shm_root = f"/dev/shm/r3-gpu-test-{os.getpid()}"
        kw["enable_routed_experts"] = True
        kw["artifact_config"] = {"shm_root": shm_root}
    elif tree == "base":
        kw["enable_return_routed_experts"] = True
    else:
        raise ValueError(tree)
    if spec.get("speculative"):
        kw["speculative_config"] = dict(spec["speculative"])
        kw["per_request_spec_decode_metrics"] = "detailed"
    for k, v in spec.get("override", {}).items():  # e.g. a CPU smoke run
        if v is None:
            kw.pop(k, None)
        else:
            kw[k] = v

    import vllm

    res: dict = {
        "spec": spec,
        "vllm_file": vllm.__file__,
        "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT"),
        "kwargs": {k: str(v) for k, v in kw.items()},
    }
    try:
        import vllm.config.artifact  # noqa: F401

        res["tree_has_artifact_config"] = True
    except ImportError:
        res["tree_has_artifact_config"] = False
    if spec.get("probe_ngram_async") and spec.get("speculative"):
        res["ngram_async_probe"] = _probe_ngram_async(kw)
    t = time.time()
    llm = LLM(**kw)
    res["init_s"] = round(time.time() - t, 1)
    cfg = llm.llm_engine.vllm_config
    # vLLM 0.34 has no other runner (the flag is gone with Model Runner V1).
    res["use_v2_model_runner"] = bool(getattr(cfg, "use_v2_model_runner", True))
    res["async_scheduling"] = cfg.scheduler_config.async_scheduling
    res["chunked_prefill"] = cfg.scheduler_config.enable_chunked_prefill
    res["max_num_batched_tokens"] = cfg.scheduler_config.max_num_batched_tokens
    res["block_size"] = cfg.cache_config.block_size
    res["num_hidden_layers"] = cfg.model_config.get_total_num_hidden_layers()
    res["top_k"] = cfg.model_config.get_num_experts_per_tok()
    res["num_experts"] = cfg.model_config.get_num_experts()
    res["tensor_parallel_size"] = cfg.parallel_config.tensor_parallel_size
    sc = cfg.speculative_config
    res["speculative"] = (
        None
        if sc is None
        else {
            k: getattr(sc, k)
            for k in (
                "method",
                "num_speculative_tokens",
                "prompt_lookup_max",
                "prompt_lookup_min",
            )
        }
    )
    try:
        res["speculator"] = llm.collective_rpc(_speculator_name)
    except Exception as e:  # noqa: BLE001
        res["speculator"] = f"collective_rpc failed: {e!r}"
    try:
        res["runner"] = llm.collective_rpc(_runner_name)
    except Exception as e:  # noqa: BLE001
        res["runner"] = f"collective_rpc failed: {e!r}"
    try:
        res["attn_backend"] = llm.collective_rpc(_attn_backend)
    except Exception as e:  # noqa: BLE001
        res["attn_backend"] = f"collective_rpc failed: {e!r}"
    res["cudagraph_mode"] = str(cfg.compilation_config.cudagraph_mode)
    if tp == 1:
        res["cudagraphs_at_start"] = llm.collective_rpc(_graph_replays)

    res["enable_eplb"] = cfg.parallel_config.enable_eplb
    eplb_log = None
    if eplb:
        eplb_log = [llm.collective_rpc(_eplb_facts_reset)]

    ps = prompts(vocab=cfg.model_config.get_vocab_size())
    arrays: dict[str, np.ndarray] = {}
    rounds = []
    round_ids = spec.get("rounds", [ROUND1, ROUND2])
    round_max = spec.get("round_max_tokens") or [spec.get("max_tokens", 16)] * len(
        round_ids
    )
    for r, (idx, max_tokens) in enumerate(zip(round_ids, round_max)):
        sp = SamplingParams(
            max_tokens=int(max_tokens),
            temperature=0.0,
            ignore_eos=True,
            detokenize=False,
        )
        t = time.time()
        outs = llm.generate(
            [{"prompt_token_ids": ps[i]} for i in idx], sp, use_tqdm=False
        )
        rr = []
        for i, o in zip(idx, outs):
            c = o.outputs[0]
            re = getattr(c, "routed_experts", None)
            d = {
                "prompt": i,
                "prompt_len": len(o.prompt_token_ids),
                "prompt_ok": list(o.prompt_token_ids) == ps[i],
                "num_cached_tokens": o.num_cached_tokens,
                "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason,
                "routed_experts_error": getattr(c, "routed_experts_error", "<no attr>"),
                "shape": None if re is None else list(re.shape),
                "dtype": None if re is None else str(re.dtype),
                "spec_decode": _spec_metrics(getattr(c, "spec_decode_metrics", None)),
            }
            if re is not None:
                arrays[f"r{r}_p{i}"] = np.asarray(re)
            rr.append(d)
        rounds.append(
            {"s": round(time.time() - t, 2), "max_tokens": int(max_tokens), "outs": rr}
        )
        if eplb_log is not None:
            eplb_log.append(llm.collective_rpc(_eplb_facts))
    res["rounds"] = rounds
    if spec.get("by_ref"):
        res["by_ref"] = _by_ref_round(llm, ps, round_ids[0], round_max[0], arrays)
    if eplb_log is not None:
        res["eplb"] = eplb_log
    if tp == 1:
        res["cudagraphs"] = llm.collective_rpc(_graph_replays)
    if tp > 1:
        sp = SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False
        )
        (o,) = llm.generate([{"prompt_token_ids": ps[1]}], sp, use_tqdm=False)
        c = o.outputs[0]
        res["probe"] = {"token_ids": list(c.token_ids), "error": c.routed_experts_error}
        if c.routed_experts is not None:
            arrays["probe"] = np.asarray(c.routed_experts)
        res["ranks"] = llm.collective_rpc(rank_facts)
        art = cfg.artifact_config
        res["store_entries"] = sorted(os.listdir(art.shm_root))
        res["namespace_rank0"] = art.namespace(0)
    t = time.time()
    llm.llm_engine.engine_core.shutdown()
    res["shutdown_s"] = round(time.time() - t, 2)
    del llm
    if shm_root is not None:
        time.sleep(0.5)
        res["shm_root_left"] = os.path.exists(shm_root)
        if res["shm_root_left"]:
            res["shm_root_entries"] = sorted(os.listdir(shm_root))[:20]
            shutil.rmtree(shm_root, ignore_errors=True)
    try:
        import vllm_pyshim as S

        res["shim_ops_missing"] = sorted(S._MISSING)
        res["shim"] = S.report()  # vLLM's kernels and stand-ins, and which ran
    except ImportError:
        pass
    res["torch"] = torch.__version__
    np.savez(out_prefix + ".npz", **arrays)
    return res


def _by_ref_round(llm, ps, idx, max_tokens, arrays) -> dict:
    """The prompts of round 0 again by reference, fetched by another
    process; compared with round 0's inline routes."""
    import subprocess

    from vllm import SamplingParams

    sp = SamplingParams(
        max_tokens=int(max_tokens),
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        routed_experts_format="ref",
    )
    outs = llm.generate([{"prompt_token_ids": ps[i]} for i in idx], sp, use_tqdm=False)
    refs, errors = {}, {}
    for i, o in zip(idx, outs):
        c = o.outputs[0]
        if c.routed_experts_ref is None:
            errors[str(i)] = c.routed_experts_error
        else:
            refs[f"p{i}"] = c.routed_experts_ref.to_json()
    out_npz = f"/tmp/r3-gpu-fetched-{os.getpid()}.npz"
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run(
        [sys.executable, os.path.join(here, "fetch_refs.py"), out_npz],
        input=json.dumps(refs),
        capture_output=True,
        text=True,
        timeout=120,
    )
    fetched_line = [x for x in p.stdout.splitlines() if x.startswith("FETCHED ")]
    res: dict = {
        "errors": errors,
        "trainer_rc": p.returncode,
        "trainer_stderr": p.stderr[-2000:],
        "refs": {
            k: {f: v[f] for f in ("transport", "shape", "dtype")}
            for k, v in refs.items()
        },  # fmt: skip
    }
    if fetched_line:
        info = json.loads(fetched_line[-1][len("FETCHED ") :])
        res.update(info)
        got = np.load(out_npz)
        res["equal"] = {
            str(i): f"p{i}" in got.files
            and f"r0_p{i}" in arrays
            and got[f"p{i}"].dtype == arrays[f"r0_p{i}"].dtype
            and np.array_equal(got[f"p{i}"], arrays[f"r0_p{i}"])
            for i in idx
        }
        os.unlink(out_npz)
    return res


def _spec_metrics(m) -> dict | None:
    """A request's speculative-decoding metrics (``detailed``): drafts
    proposed, accepted and rejected, and per verify step."""
    if m is None:
        return None
    hist = list(m.histogram)
    accepted = sum(j * n for j, n in enumerate(hist))
    return {
        "num_draft_tokens": int(m.num_draft_tokens),
        "accepted": int(accepted),
        "rejected": int(m.num_draft_tokens - accepted),
        "histogram": hist,
        "per_step_accepted": list(m.per_step_accepted),
        "per_step_drafted": list(m.per_step_drafted),
    }


def _probe_ngram_async(kw: dict) -> str:
    """Does the config accept ``method="ngram"`` with async scheduling on?
    Only the config is built (no engine, no R3 store)."""
    from vllm.engine.arg_utils import EngineArgs

    skip = ("enable_routed_experts", "artifact_config", "enable_return_routed_experts")
    pkw = {k: v for k, v in kw.items() if k not in skip}
    pkw["speculative_config"] = dict(kw["speculative_config"], method="ngram")
    pkw["async_scheduling"] = True
    try:
        cfg = EngineArgs(**pkw).create_engine_config()
    except Exception as e:  # noqa: BLE001
        return f"refused: {type(e).__name__}: {e}"[:2000]
    return f"accepted (async_scheduling={cfg.scheduler_config.async_scheduling})"


def main() -> int:
    spec = json.loads(sys.argv[1])
    out_prefix = sys.argv[2]
    t0 = time.time()
    ok = True
    try:
        res = run(spec, out_prefix)
    except BaseException as e:  # noqa: BLE001
        traceback.print_exc()
        ok = False
        res = {
            "spec": spec,
            "error": repr(e)[:3000],
            "traceback": traceback.format_exc()[-6000:],
        }
    res["ok"] = ok
    res["wall_s"] = round(time.time() - t0, 1)
    with open(out_prefix + ".json", "w") as f:
        json.dump(res, f, default=str)
    summary = {k: v for k, v in res.items() if k not in ("rounds", "traceback")}
    print("RESULT " + json.dumps(summary, default=str), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
