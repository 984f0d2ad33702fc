# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Decode throughput and per-request latency with routed experts (R3) on the
GPU: R3 off, the base's own R3 (AuxOutput, pristine 0.32.0 tree) and the
fork's R3 (Artifact Connector). Prints JSON.

For the GPU harness (../shared/tools/gpu/README.md): the fork's Python tree
on PYTHONPATH (``BENCH_FORK_SITE``, default ``/tmp/site``), the pristine tree
in ``BENCH_BASE_SITE`` (default ``/tmp/site_base``, unpacked from
``.devcarry/base_site.tgz`` when missing). The compiled ops are pure-torch
stand-ins there, so absolute numbers mean little: read the ratios.

Model: Qwen3-30B-A3B's shape (48 layers, hidden 2048, 128 experts, top-8,
MoE intermediate 768, 32/4 heads), dummy weights, bfloat16, eager,
TRITON_ATTN, the Triton MoE, prefix caching on in every setting (the fork's
R3 needs it). Each setting runs in its own process; settings alternate
(default ``off base fork off base fork``). In each process: one warm-up
round of the same shape (64 other prompts, 4 new tokens; Triton compiles
its kernels there), then the timed round: 64 distinct 128-token prompts
submitted at once, ``BENCH_TOKENS`` (128) new tokens each, greedy,
``ignore_eos``, stepped through ``LLMEngine.step()`` so every request's
finish time is seen; ``BENCH_REPS`` (1) timed rounds per process, each with
new prompts. Per setting, the figures are means over all timed rounds of
all its processes.

* ``tok_per_s``: generated tokens / wall time of the timed round;
* ``decode_tok_per_s``: tokens generated after the first step (the
  prefill) / the time after it;
* ``mean_latency_s``: mean over requests of (finish - submit).

``BENCH_TIME_CONNECTOR=1`` (TP=1 only: the scheduler and the worker then
share the benchmark's process) times the connector's methods on the engine's
threads with ``time.perf_counter`` and the calling thread's CPU clock and
reports, per timed round, each method's wall time, calls and CPU time
(``connector_s``) and their wall total against the round's
(``connector_share``).

``BENCH_GRAPHS=1`` decodes with full CUDA graphs (``compilation_config=
{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}``, the harness's capturable
stand-ins); each round then also reports ``decode_step_ms`` (the median
decode step) and ``host_cpu_ms_per_step`` (the process's CPU time per decode
step: the engine core and the worker share it at TP=1), split by thread in
``host_cpu_ms_per_step_by_thread`` (each Python thread by name, ``native``
for the threads Python does not know).

``BENCH_FINISH_STAGES=1`` (TP=1 only, the fork) logs the engine step at
which each stage of a finishing request happens: the finish (the
scheduler's ``on_finish``), the worker's acknowledgement arriving, the
output emitted with its routes, and the step whose ``LLMEngine.step()``
returned the last output; each round reports them relative to the step of
the last finish (``finish_tail``), and the steps the engine ran after it.

``BENCH_TP=2`` runs every setting at tensor parallelism 2 (two GPUs, the
EngineCore in its own process, no custom all-reduce kernel).

Run (device): ``python3 benchmarks/bench_r3_gpu.py [off base fork ...]``
Worker (internal): ``python3 benchmarks/bench_r3_gpu.py --worker SETTING``
Settings: ``off`` (pristine tree, R3 off), ``base``, ``fork``, ``fork_off``
(fork tree, R3 off).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEQS = int(os.environ.get("BENCH_SEQS", "64"))
PROMPT = int(os.environ.get("BENCH_PROMPT", "128"))
TOKENS = int(os.environ.get("BENCH_TOKENS", "128"))
REPS = int(os.environ.get("BENCH_REPS", "1"))
LAYERS = int(os.environ.get("BENCH_LAYERS", "48"))
TP = int(os.environ.get("BENCH_TP", "1"))
VOCAB = int(os.environ.get("BENCH_VOCAB", "151936"))
WORKER_TIMEOUT_S = float(os.environ.get("BENCH_WORKER_TIMEOUT", "240"))
DEADLINE_S = float(os.environ.get("BENCH_DEADLINE", "560"))
FORK_SITE = os.environ.get("BENCH_FORK_SITE", "/tmp/site")
BASE_SITE = Path(os.environ.get("BENCH_BASE_SITE", "/tmp/site_base"))
BASE_TGZ = ROOT / ".devcarry" / "base_site.tgz"
SETTINGS = {  # tree, R3 switch
    "off": ("base", None),
    "base": ("base", "enable_return_routed_experts"),
    "fork": ("fork", "enable_routed_experts"),
    "fork_off": ("fork", None),
}


def write_model(path: Path) -> Path:
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": LAYERS,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "use_sliding_window": False,
        "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2,
        "output_router_logits": False, "router_aux_loss_coef": 0.0,
        "torch_dtype": "bfloat16", "dtype": "bfloat16",
    }  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def _prompts(offset: int) -> list[dict]:
    return [
        {
            "prompt_token_ids": [
                (7919 * (i + offset) + 13 * j) % (VOCAB - 100) + 100
                for j in range(PROMPT)
            ]
        }
        for i in range(SEQS)
    ]


_TIMED: dict[str, list[float]] = {}  # method -> [seconds, calls]
# BENCH_FINISH_STAGES: the engine step now, and per stage {step: count}.
_STEP = [0]
_STAGES: dict[str, dict[int, int]] = {}


def _log_finish_stages() -> None:
    """Count the finish stages per engine step (see the module docs)."""
    from vllm.distributed.artifact_connector import scheduler

    cls = scheduler.ArtifactSchedulerConnector

    def bump(stage: str, n: int = 1) -> None:
        if n:
            d = _STAGES.setdefault(stage, {})
            d[_STEP[0]] = d.get(_STEP[0], 0) + n

    on_finish, update, emit = cls.on_finish, cls.update_from_output, cls._emit

    def logged_on_finish(self, request):
        bump("finish")
        return on_finish(self, request)

    def logged_update(self, report, outputs, finish_requests):
        if report is not None:
            bump("ack", len(report.acks))
        return update(self, report, outputs, finish_requests)

    def logged_emit(self, *args, **kwargs):
        bump("emit")
        return emit(self, *args, **kwargs)

    cls.on_finish = logged_on_finish  # type: ignore[method-assign]
    cls.update_from_output = logged_update  # type: ignore[method-assign]
    cls._emit = logged_emit  # type: ignore[method-assign]


def _finish_tail(steps: int, last_output_step: int) -> dict | None:
    """The stages relative to the last finish's step (0)."""
    if "finish" not in _STAGES:
        return None
    last = max(_STAGES["finish"])
    return {
        "last_finish_step": last,
        **{
            stage: {str(k - last): v for k, v in sorted(d.items()) if k >= last}
            for stage, d in _STAGES.items()
        },
        "last_output": last_output_step - last,
        "steps_after_last_finish": steps - 1 - last,
    }


def _time_connector() -> None:
    """Accumulate the wall time of the connector's per-step methods."""
    from vllm.distributed.artifact_connector import scheduler, worker

    methods = {
        scheduler.ArtifactSchedulerConnector: (
            "build_meta", "update_from_output", "on_finish", "has_pending",
        ),
        worker.ArtifactWorkerConnector: (
            "begin_step", "prepare_step", "process", "no_forward",
        ),
        worker.PendingArtifactStep: ("enqueue_cpu_copy",),
    }  # fmt: skip
    for cls, names in methods.items():
        for name in names:
            orig = getattr(cls, name)
            acc = _TIMED.setdefault(f"{cls.__name__}.{name}", [0.0, 0, 0.0])

            def timed(*args, _orig=orig, _acc=acc, **kwargs):
                t, c = time.perf_counter(), time.thread_time()
                try:
                    return _orig(*args, **kwargs)
                finally:
                    _acc[0] += time.perf_counter() - t
                    _acc[1] += 1
                    _acc[2] += time.thread_time() - c

            setattr(cls, name, timed)


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each Python thread so far, by name (threads of one
    name add up), and of the whole process under ``"process"``."""
    out: dict[str, float] = {"process": time.process_time()}
    for t in threading.enumerate():
        if t.ident is None:
            continue
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except OSError:  # it ended meanwhile
            continue
        out[t.name] = out.get(t.name, 0.0) + cpu
    return out


def _cpu_by_thread(first: dict[str, float], last: dict[str, float], steps: int):
    """ms per step of each thread between two :func:`_thread_cpu` (a thread
    started meanwhile counts from 0); ``"native"``: the process's threads
    Python does not know (CUDA's, the compiled ops' pools)."""
    per = {
        name: 1e3 * (cpu - first.get(name, 0.0)) / steps for name, cpu in last.items()
    }
    per["native"] = per["process"] - sum(v for k, v in per.items() if k != "process")
    return {k: round(v, 3) for k, v in sorted(per.items()) if abs(v) >= 0.001}


def _timed_round(engine, offset: int) -> dict:
    """SEQS new prompts submitted at once, stepped to the end; each request's
    finish time is taken when its final output comes back."""
    import torch

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(
        max_tokens=TOKENS,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for acc in _TIMED.values():
        acc[:] = [0.0, 0, 0.0]
    _STAGES.clear()
    t0 = time.perf_counter()
    submit, ids = {}, {}
    for i, p in enumerate(_prompts(offset)):
        rid = f"bench-{offset}-{i}"
        submit[rid] = time.perf_counter()
        ids[engine.add_request(rid, p, sp)] = rid
    finish: dict[str, float] = {}
    outs = {}
    t_first = None
    steps = 0
    step_s: list[float] = []
    cpu_first = 0.0
    threads_first: dict[str, float] = {}
    last_output_step = 0
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        _STEP[0] = steps
        for o in engine.step():
            if o.finished:
                rid = ids.get(o.request_id, o.request_id)
                finish[rid] = time.perf_counter()
                outs[rid] = o
                last_output_step = steps
        steps += 1
        step_s.append(time.perf_counter() - ts)
        if t_first is None:
            t_first = time.perf_counter()
            cpu_first = time.process_time()
            threads_first = _thread_cpu()
    t_end = time.perf_counter()
    cpu_decode = time.process_time() - cpu_first
    threads_last = _thread_cpu()
    decode_steps = sorted(step_s[1:]) or [0.0]
    new = sum(len(o.outputs[0].token_ids) for o in outs.values())
    lat = [finish[r] - submit[r] for r in finish]
    c0 = outs[f"bench-{offset}-0"].outputs[0]
    re = getattr(c0, "routed_experts", None)
    errors = sorted(
        {
            str(getattr(o.outputs[0], "routed_experts_error", None))
            for o in outs.values()
        }
    )
    return dict(
        requests=len(outs),
        new_tokens=new,
        steps=steps,
        wall_s=round(t_end - t0, 3),
        tok_per_s=round(new / (t_end - t0), 1),
        decode_tok_per_s=round((new - len(outs)) / (t_end - t_first), 1),
        first_step_s=round(t_first - t0, 3),
        # Decode steps (all but the first): the median step's wall time, and
        # the process's CPU time per step (the host side of the step: with
        # the engine core and the worker in this process, everything but
        # the GPU).
        decode_step_ms=round(1e3 * decode_steps[len(decode_steps) // 2], 3),
        host_cpu_ms_per_step=round(1e3 * cpu_decode / max(1, steps - 1), 3),
        host_cpu_ms_per_step_by_thread=_cpu_by_thread(
            threads_first, threads_last, max(1, steps - 1)
        ),
        mean_latency_s=round(sum(lat) / len(lat), 3),
        max_latency_s=round(max(lat), 3),
        r3_shape=None if re is None else list(re.shape),
        r3_dtype=None if re is None else str(re.dtype),
        r3_none=sum(
            getattr(o.outputs[0], "routed_experts", None) is None for o in outs.values()
        ),
        routed_experts_errors=errors,
        # method: [wall s, calls, CPU s of the calling thread]
        connector_s={
            k: [round(v[0], 4), v[1], round(v[2], 4)] for k, v in _TIMED.items()
        }
        or None,
        finish_tail=_finish_tail(steps, last_output_step),
        connector_share=(
            round(sum(v[0] for v in _TIMED.values()) / (t_end - t0), 4)
            if _TIMED
            else None
        ),
    )


# ----------------------------------------------------------------------------
# Worker: one setting, one engine
# ----------------------------------------------------------------------------


def worker(setting: str) -> dict:
    from vllm import LLM, SamplingParams

    tree, switch = SETTINGS[setting]
    model = os.environ.get("BENCH_MODEL_DIR") or write_model(
        Path(f"/tmp/bench_r3_moe_{LAYERS}")
    )
    kw = dict(
        model=str(model), load_format="dummy", skip_tokenizer_init=True,
        enforce_eager=True, enable_prefix_caching=True,
        attention_backend="TRITON_ATTN", moe_backend="triton", dtype="bfloat16",
        max_model_len=1024, max_num_seqs=SEQS, max_num_batched_tokens=8192,
        kv_cache_memory_bytes=(4 << 30) * max(1, SEQS // 64),
        gpu_memory_utilization=0.9, seed=0,
    )  # fmt: skip
    if TP > 1:
        kw.update(tensor_parallel_size=TP, disable_custom_all_reduce=True)
    if os.environ.get("BENCH_GRAPHS") == "1":
        # Decode replays full CUDA graphs (tests/gpu/vllm_pyshim.py's
        # stand-ins are capturable); compiled mode stays off.
        kw.update(
            enforce_eager=False,
            compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
        )
    # BENCH_OVERRIDE: JSON of engine arguments to set (null: drop), e.g. for a
    # smoke run of this script on the CPU harness.
    for k, v in json.loads(os.environ.get("BENCH_OVERRIDE", "{}")).items():
        if v is None:
            kw.pop(k, None)
        else:
            kw[k] = v
    shm_root = None
    if switch is not None:
        kw[switch] = True
    if setting == "fork":
        shm_root = f"/dev/shm/bench-r3-{os.getpid()}"
        kw["artifact_config"] = {"shm_root": shm_root}
    row: dict = {"setting": setting, "tree": tree}
    if os.environ.get("BENCH_TIME_CONNECTOR") == "1" and tree == "fork" and switch:
        if TP > 1:
            raise ValueError("BENCH_TIME_CONNECTOR needs BENCH_TP=1 (one process)")
        _time_connector()
    if os.environ.get("BENCH_FINISH_STAGES") == "1" and tree == "fork" and switch:
        if TP > 1:
            raise ValueError("BENCH_FINISH_STAGES needs BENCH_TP=1 (one process)")
        _log_finish_stages()
    t = time.time()
    llm = LLM(**kw)
    row["init_s"] = round(time.time() - t, 1)
    cfg = llm.llm_engine.vllm_config
    # vLLM 0.34 has no other runner (the flag is gone with Model Runner V1).
    row["use_v2_model_runner"] = bool(getattr(cfg, "use_v2_model_runner", True))
    row["async_scheduling"] = cfg.scheduler_config.async_scheduling

    # Warm-up of the timed round's shape (prefill of SEQS x PROMPT, decode
    # batch SEQS), other prompts so the timed round has no prefix hits.
    t = time.time()
    llm.generate(
        _prompts(10_000),
        SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False),
        use_tqdm=False,
    )
    row["warmup_s"] = round(time.time() - t, 1)

    engine = llm.llm_engine
    reps = [_timed_round(engine, offset=1000 * (k + 1)) for k in range(REPS)]
    row["reps"] = reps
    row["graphs"] = str(cfg.compilation_config.cudagraph_mode)
    for key in (
        "tok_per_s",
        "decode_tok_per_s",
        "mean_latency_s",
        "decode_step_ms",
        "host_cpu_ms_per_step",
    ):
        row[key] = round(sum(r[key] for r in reps) / len(reps), 3)
    for key in ("r3_shape", "r3_dtype", "routed_experts_errors"):
        row[key] = reps[-1][key]
    row["r3_none"] = sum(r["r3_none"] for r in reps)
    row["steps"] = [r["steps"] for r in reps]
    engine.engine_core.shutdown()
    if shm_root is not None:
        time.sleep(0.3)
        row["shm_root_left"] = os.path.exists(shm_root)
    return row


# ----------------------------------------------------------------------------
# Driver: one process per setting, alternating
# ----------------------------------------------------------------------------


def _env(setting: str) -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    # As the GPU harness's TP=2 case was proven: the EngineCore in its own
    # process when there are several workers.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if TP > 1 else "0"
    rest = env.get("PYTHONPATH", FORK_SITE)
    if SETTINGS[setting][0] == "base":
        if not BASE_SITE.is_dir() and BASE_TGZ.is_file():
            BASE_SITE.mkdir(parents=True, exist_ok=True)
            with tarfile.open(BASE_TGZ) as tf:
                tf.extractall(BASE_SITE)
        env["PYTHONPATH"] = f"{BASE_SITE}:{rest}"
    else:
        env["PYTHONPATH"] = rest
    return env


def _mean(xs):
    return round(sum(xs) / len(xs), 3) if xs else None


def driver(order: list[str]) -> dict:
    out_dir = Path(os.environ.get("OUT", "/tmp")) / "bench_r3"
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    runs, skipped = [], []
    longest = 0.0
    for k, setting in enumerate(order):
        left = DEADLINE_S - (time.time() - t0)
        if left < max(longest * 1.15, 30):
            skipped.extend(order[k:])
            break
        t = time.time()
        log = out_dir / f"{k}_{setting}.log"
        with open(log, "w") as f:
            try:
                p = subprocess.run(
                    [sys.executable, __file__, "--worker", setting],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env=_env(setting),
                    cwd=str(ROOT),
                    timeout=min(WORKER_TIMEOUT_S, left),
                )
                rc = p.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = log.read_text(errors="replace")
        row = None
        for line in text.splitlines():
            if line.startswith("BENCHROW "):
                row = json.loads(line[len("BENCHROW ") :])
        if row is None:
            row = {"setting": setting, "error": f"rc={rc}", "log_tail": text[-3000:]}
        row["process_s"] = round(time.time() - t, 1)
        longest = max(longest, time.time() - t)
        runs.append(row)
        print(f"[bench] {json.dumps(row)}", file=sys.stderr, flush=True)

    per: dict[str, dict] = {}
    for s in dict.fromkeys(order):
        # every timed round of every process of this setting
        ok = [x for r in runs if r["setting"] == s and "reps" in r for x in r["reps"]]
        per[s] = {
            "n": len(ok),
            "tok_per_s": [r["tok_per_s"] for r in ok],
            "decode_tok_per_s": [r["decode_tok_per_s"] for r in ok],
            "mean_latency_s": [r["mean_latency_s"] for r in ok],
            "decode_step_ms": [r.get("decode_step_ms") for r in ok],
            "host_cpu_ms_per_step": [r.get("host_cpu_ms_per_step") for r in ok],
            "host_cpu_ms_per_step_mean": _mean(
                [r.get("host_cpu_ms_per_step") or 0.0 for r in ok]
            ),
            "host_cpu_ms_per_step_by_thread_mean": {
                name: _mean(
                    [r["host_cpu_ms_per_step_by_thread"].get(name, 0.0) for r in ok]
                )
                for name in sorted(
                    {n for r in ok for n in r.get("host_cpu_ms_per_step_by_thread", {})}
                )
            },
            "tok_per_s_mean": _mean([r["tok_per_s"] for r in ok]),
            "decode_tok_per_s_mean": _mean([r["decode_tok_per_s"] for r in ok]),
            "mean_latency_s_mean": _mean([r["mean_latency_s"] for r in ok]),
        }
    ratios = {}
    off = per.get("off", {})
    for s in ("base", "fork", "fork_off"):
        if s in per and per[s]["n"] and off.get("n"):
            ratios[f"{s}/off"] = {
                "tok_per_s": round(per[s]["tok_per_s_mean"] / off["tok_per_s_mean"], 3),
                "decode_tok_per_s": round(
                    per[s]["decode_tok_per_s_mean"] / off["decode_tok_per_s_mean"], 3
                ),
                "mean_latency_s": round(
                    per[s]["mean_latency_s_mean"] / off["mean_latency_s_mean"], 3
                ),
            }
    if per.get("fork", {}).get("n") and per.get("base", {}).get("n"):
        ratios["fork/base"] = {
            "tok_per_s": round(
                per["fork"]["tok_per_s_mean"] / per["base"]["tok_per_s_mean"], 3
            ),
            "mean_latency_s": round(
                per["fork"]["mean_latency_s_mean"] / per["base"]["mean_latency_s_mean"],
                3,
            ),
        }
    return {
        "config": {
            "layers": LAYERS,
            "tensor_parallel_size": TP,
            "experts": 128,
            "top_k": 8,
            "hidden": 2048,
            "seqs": SEQS,
            "prompt": PROMPT,
            "new_tokens": TOKENS,
            "dtype": "bfloat16",
            "order": order,
        },
        "runs": runs,
        "per_setting": per,
        "ratios": ratios,
        "skipped": skipped,
        "total_s": round(time.time() - t0, 1),
    }


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        try:
            row = worker(sys.argv[2])
        except BaseException as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            row = {"setting": sys.argv[2], "error": repr(e)[:2000]}
        print("BENCHROW " + json.dumps(row, default=str), flush=True)
        sys.stdout.flush()
        os._exit(0 if "error" not in row else 1)
    order = sys.argv[1:] or ["off", "base", "fork", "off", "base", "fork"]
    result = driver(order)
    text = json.dumps(result, indent=1, default=str)
    out = Path(os.environ.get("OUT", "/tmp")) / "bench_r3" / "result.json"
    out.write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
