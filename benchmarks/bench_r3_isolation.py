# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routes by reference through a frozen Mooncake master, against the same
traffic with the master running, in one run (issue 27): what a frozen
reference transport costs requests that never asked for it, and the engine
core's step loop. Prints JSON.

One real ``vllm serve`` of the tiny Qwen3-MoE (``tools/build_tiny_moe.py``,
float32) on the CPU harness (``tools/cpu_harness/harness_env.py``: Model
Runner V2, Triton kernels in Triton's interpreter, caches under ``.cache/``),
``--enable-routed-experts``, ``--max-num-seqs`` 8, block size 32, and
``--artifact-config`` ``ref_transport: mooncake`` against a real
``mooncake_master`` on 127.0.0.1 (``benchmarks/mooncake_master.py``, TCP).
Routes are inline by default; a request asks for a reference with
``routed_experts_format: "ref"`` in its body.

After a warm-up (inline and ``ref`` requests, one reference fetched), rounds
alternate ``calm`` and ``frozen`` (``--rounds`` of each, calm first). A
round sends 32 concurrent ``/v1/completions`` (``--requests``; 8 new tokens,
greedy, ``ignore_eos``, ``return_token_ids``, prompts new in every round),
the odd ones with ``routed_experts_format: "ref"``. In a ``frozen`` round the
master is stopped (``SIGSTOP``) just before the requests are released and
continued (``SIGCONT``) as soon as all of them have answered, at most after
``--freeze-s`` (20 s). Every round is followed by a pause of ``--pause-s``
(10 s: the breaker on the reference transport pauses calls for up to 8 s)
in which the answers are checked: every inline array is decoded (base64
``.npy``, numpy only) and must be ``[prompt + completion - 1, layers,
top_k]``; every reference is fetched in a separate consumer process that
imports ``vllm_host_transport.routed_experts.fetch`` and Mooncake's client
only (it reports any ``vllm``/``torch`` module it loaded), and the fetched
array must have the same shape; every failed ``ref`` request must name
``RouteRefPublishError``.

Latency is a request's time from its release to its whole answer, at the
client. Reported per setting, pooled over its rounds: inline p50/p99/max
(and frozen/calm ratios; goal: p99 at most 1.2x), ``ref`` requests that got
a reference and that failed with ``RouteRefPublishError`` (and their
latencies), fetch results.

Step loop: a ``sitecustomize`` the script writes into
``.cache/bench-r3-isolation/boot`` is on the server's ``PYTHONPATH``; when
vLLM imports ``vllm.v1.engine.core`` in any process of the server it wraps
``EngineCore.step`` and ``step_with_batch_queue``, and the engine core
records per step ``(start, duration, model executed, scheduler still has
requests)`` (``time.monotonic``, the same clock as this driver), in memory;
the records go to ``<pid>.steps`` when a step leaves the scheduler without
requests (the engine then idles, so the write costs no gap) and at exit.
Within each round's window (release to last answer): the longest step, and
the longest gap from the end of a step to the start of the next one while the
scheduler still had requests after the first (``has_requests()``: the loop
had work and did not step). Calm rounds are the baseline of the machine (2
shared cores, the API server and this client on them); the goal is no gap
caused by the tier above 50 ms.

Run (from the repository root, under the engine lock of the shared machine):
``mkdir -p .cache && flock .cache/engine.lock .venv/bin/python
benchmarks/bench_r3_isolation.py [--rounds 3] [--out FILE]``
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools" / "cpu_harness"))
sys.path.insert(0, str(ROOT / "tools"))
from harness_env import CACHE, apply_harness_env, harness_env, run_tmpdir

# Every cache and temporary file of this process (and of the master and the
# consumer it starts) under .cache/; this process imports neither vLLM nor
# torch.
apply_harness_env(enable_triton_interpreter=False)

import argparse
import base64
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid

import numpy as np
from machine import machine_facts
from mooncake_master import start_master

WORK = CACHE / "bench-r3-isolation"
LOG = CACHE / "logs" / "bench-r3-isolation-serve.log"
MODEL_NAME = "tiny-moe"
BLOCK_SIZE = 32
PROMPTS = [
    "Hello, how are you today?",
    "Mixture of experts models route every token to a few experts.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text.",
    "def add(a, b): return a + b",
    "Write a short poem about the sea and the sky.",
    "Once",
]

# ----------------------------------------------------------------------------
# The step timers' bootstrap (a sitecustomize on the server's PYTHONPATH). It
# patches EngineCore when vllm.v1.engine.core is imported, in whichever
# process of the server that is; only the engine core steps. Records stay in
# memory while the engine has work: a file write there would be a gap of its
# own.
# ----------------------------------------------------------------------------
STEP_BOOT = r'''
"""Step timers of the engine core (benchmarks/bench_r3_isolation.py)."""
import os

if os.environ.get("BENCH_R3_ISO_STEPS"):
    import atexit
    import importlib.abc
    import sys
    import time

    _DIR = os.environ["BENCH_R3_ISO_STEPS"]
    _REC = []
    _DONE = [0]

    def _flush():
        new = _REC[_DONE[0]:]
        _DONE[0] += len(new)
        if not new:
            return
        lines = "".join(f"{t!r} {d!r} {int(e)} {int(p)}\n" for t, d, e, p in new)
        with open(os.path.join(_DIR, f"{os.getpid()}.steps"), "a") as f:
            f.write(lines)

    def _wrap(cls, name):
        orig = getattr(cls, name)
        mono = time.monotonic

        def timed(self, *args, **kwargs):
            t = mono()
            executed = False
            try:
                out = orig(self, *args, **kwargs)
                executed = bool(out[1])
                return out
            finally:
                d = mono() - t
                try:
                    pending = bool(self.scheduler.has_requests())
                except Exception:  # noqa: BLE001
                    pending = True
                _REC.append((t, d, executed, pending))
                if not pending:
                    _flush()

        timed.__wrapped__ = orig
        setattr(cls, name, timed)

    def _patch(mod):
        _wrap(mod.EngineCore, "step")
        _wrap(mod.EngineCore, "step_with_batch_queue")

    class _Loader(importlib.abc.Loader):
        def __init__(self, inner):
            self.inner = inner

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module):
            self.inner.exec_module(module)
            _patch(module)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "vllm.v1.engine.core":
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    spec.loader = _Loader(spec.loader)
                    return spec
            return None

    sys.meta_path.insert(0, _Finder())
    atexit.register(_flush)
'''

# The trainer's side: one process for the run, fed one reference per line;
# answers with the fetched array's shape and dtype or the error's type, and
# the vllm/torch modules it has loaded (none expected).
CONSUMER = r"""
import json, sys, time
from vllm_host_transport.routed_experts import RouteRefError, fetch
for line in sys.stdin:
    ref = json.loads(line)
    t0 = time.perf_counter()
    try:
        routes = fetch(ref)
    except RouteRefError as e:
        answer = {"error": type(e).__name__, "message": str(e)[:300]}
    else:
        answer = {"shape": list(routes.shape), "dtype": str(routes.dtype)}
        del routes
    answer["s"] = time.perf_counter() - t0
    answer["loaded"] = sorted(
        m for m in sys.modules if m.split(".")[0] in ("vllm", "torch"))
    print(json.dumps(answer), flush=True)
"""


# ----------------------------------------------------------------------------
# Processes
# ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``vllm serve`` in the harness environment, in a session of its own
    (its group is stopped with SIGINT, then SIGKILL), logging to ``LOG``."""

    def __init__(self, model: Path, flags: list[str], steps_dir: Path) -> None:
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.tmpdir = run_tmpdir("bench-iso-server")
        env = dict(os.environ, **harness_env())
        env["TMPDIR"] = str(self.tmpdir)
        boot = str(WORK / "boot")
        old = env.get("PYTHONPATH")
        env["PYTHONPATH"] = boot if not old else f"{boot}{os.pathsep}{old}"
        env["BENCH_R3_ISO_STEPS"] = str(steps_dir)
        vllm = Path(sys.executable).with_name("vllm")
        cmd = [str(vllm), "serve", str(model), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), *flags]
        self.cmd = cmd
        LOG.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(LOG, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_healthy(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode}; log: {LOG}"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2):
                    return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        raise TimeoutError(f"vllm serve not healthy after {timeout_s} s; log: {LOG}")

    def stop(self) -> dict:
        pgid = self.proc.pid  # its own session: pgid == pid
        how = "exited"
        for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            how = sig.name
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(pgid):
                time.sleep(0.2)
                self.proc.poll()
            if not _group_alive(pgid):
                break
        self.proc.poll()
        self._log.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        return {"stopped_by": how, "returncode": self.proc.returncode}


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class Consumer:
    """A trainer process next to the engine: no vLLM, no torch."""

    def __init__(self, tmpdir: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["MC_FORCE_TCP"] = "true"
        env["VLLM_MOONCAKE_BUFFER_BYTES"] = str(32 << 20)
        env["TMPDIR"] = str(tmpdir)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CONSUMER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # Mooncake's own logging
            text=True,
            env=env,
            cwd=tmpdir,
        )

    def fetch(self, ref: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(ref) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the consumer exited")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


# ----------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------
def _post(base_url: str, body: dict, timeout: float) -> tuple[int, dict]:
    req = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {"error": "unparsable error body"}
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, {"error": repr(e)}


def _body(prompt: str, fmt: str, max_tokens: int) -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "routed_experts_format": fmt,
    }


def _send_round(
    base_url: str,
    jobs: list[tuple[str, str]],
    max_tokens: int,
    master: subprocess.Popen | None,
    freeze_s: float,
    timeout_s: float,
) -> dict:
    """Release ``jobs`` (prompt, format) at once; with ``master``, stop it
    just before and continue it once all have answered (at most after
    ``freeze_s``)."""
    n = len(jobs)
    results: list[dict | None] = [None] * n
    go = threading.Event()
    all_done = threading.Event()
    lock = threading.Lock()
    count = [0]
    t_release = [0.0]

    def one(i: int) -> None:
        prompt, fmt = jobs[i]
        body = _body(prompt, fmt, max_tokens)
        go.wait()
        status, answer = _post(base_url, body, timeout_s)
        t = time.monotonic()
        results[i] = {
            "fmt": fmt,
            "status": status,
            "body": answer,
            "answered": t,
            "latency_s": t - t_release[0],
        }
        with lock:
            count[0] += 1
            if count[0] == n:
                all_done.set()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # every thread waits on `go`
    t_stop = t_cont = None
    try:
        if master is not None:
            os.kill(master.pid, signal.SIGSTOP)
            t_stop = time.monotonic()
        t_release[0] = time.monotonic()
        go.set()
        if master is not None:
            all_done.wait(timeout=max(0.0, t_stop + freeze_s - time.monotonic()))
    finally:
        if master is not None:
            os.kill(master.pid, signal.SIGCONT)
            t_cont = time.monotonic()
    for t in threads:
        t.join(timeout=max(1.0, t_release[0] + timeout_s + 5 - time.monotonic()))
    done = [r for r in results if r is not None]
    out = {
        "release": t_release[0],
        "last_answer": max((r["answered"] for r in done), default=time.monotonic()),
        "results": results,
        "unanswered": n - len(done),
    }
    if master is not None:
        out["stopped"] = t_stop
        out["continued"] = t_cont
        out["frozen_s"] = round(t_cont - t_stop, 3)
        out["answered_while_frozen"] = sum(1 for r in done if r["answered"] <= t_cont)
    return out


def _check_round(rnd: dict, consumer: Consumer, layers: int, top_k: int) -> dict:
    """Decode the inline arrays, fetch the references; shapes checked."""
    inline_ok, inline_bad, ref_ok, ref_failed = 0, [], 0, 0
    ref_other, fetched_ok, fetch_bad, fetch_s = [], 0, [], []
    loaded: set[str] = set()
    for i, r in enumerate(rnd["results"]):
        if r is None:
            continue
        body, status = r["body"], r["status"]
        choice = (body.get("choices") or [None])[0] if status == 200 else None
        if choice is not None:
            rows = len(choice["prompt_token_ids"]) + len(choice["token_ids"]) - 1
            usage = body.get("usage") or {}
            usage_rows = (
                usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0) - 1
            )
            want = [rows, layers, top_k]
        if r["fmt"] == "inline":
            if choice is None or choice.get("routed_experts") is None:
                inline_bad.append({"i": i, "status": status, "body": str(body)[:300]})
                continue
            raw = base64.b64decode(choice["routed_experts"])
            arr = np.load(io.BytesIO(raw), allow_pickle=False)
            if list(arr.shape) != want or rows != usage_rows:
                inline_bad.append({"i": i, "shape": list(arr.shape), "want": want})
            else:
                inline_ok += 1
            continue
        if choice is None:
            if "RouteRefPublishError" in json.dumps(body):
                ref_failed += 1
                r["ref"] = "RouteRefPublishError"
            else:
                ref_other.append({"i": i, "status": status, "body": str(body)[:300]})
                r["ref"] = "other"
            continue
        ref = choice.get("routed_experts_ref")
        if ref is None or ref.get("transport") != "mooncake":
            ref_other.append({"i": i, "status": status, "ref": ref})
            r["ref"] = "other"
            continue
        ref_ok += 1
        r["ref"] = "reference"
        got = consumer.fetch(ref)
        loaded.update(got.get("loaded", []))
        fetch_s.append(got["s"])
        if "error" in got:
            fetch_bad.append({"i": i, "error": got["error"], "msg": got["message"]})
        elif got["shape"] != want or list(ref["shape"]) != want:
            fetch_bad.append({"i": i, "shape": got["shape"], "want": want})
        else:
            fetched_ok += 1
    return {
        "inline_ok": inline_ok,
        "inline_bad": inline_bad,
        "ref_reference": ref_ok,
        "ref_RouteRefPublishError": ref_failed,
        "ref_other": ref_other,
        "fetched_ok": fetched_ok,
        "fetch_bad": fetch_bad,
        "fetch_ms_max": round(1e3 * max(fetch_s), 2) if fetch_s else None,
        "consumer_loaded": sorted(loaded),
    }


# ----------------------------------------------------------------------------
# Step records
# ----------------------------------------------------------------------------
def _read_steps(steps_dir: Path) -> list[tuple[float, float, bool, bool]]:
    recs = []
    for path in steps_dir.glob("*.steps"):
        for line in path.read_text().splitlines():
            t, d, e, p = line.split()
            recs.append((float(t), float(d), e == "1", p == "1"))
    recs.sort()
    return recs


def _step_loop(recs: list, rnd: dict) -> dict:
    """The longest step and the longest gap with work pending, in the
    round's window (release to last answer); times in ms, ``at_s`` from the
    release."""
    lo, hi = rnd["release"], rnd["last_answer"]
    win = [r for r in recs if lo <= r[0] <= hi]
    cont = rnd.get("continued")
    out: dict = {"steps": len(win), "executed": sum(1 for r in win if r[2])}
    if not win:
        return out
    longest = max(win, key=lambda r: r[1])
    out["longest_step_ms"] = round(1e3 * longest[1], 2)
    out["longest_step"] = {
        "at_s": round(longest[0] - lo, 3),
        "executed": longest[2],
        "while_frozen": cont is not None and longest[0] < cont,
    }
    empty = [r[1] for r in win if not r[2]]
    if empty:
        out["longest_empty_step_ms"] = round(1e3 * max(empty), 2)
    ex = [r[1] for r in win if r[2]]
    if ex:
        out["executed_step_ms"] = {
            "p50": round(1e3 * float(np.percentile(ex, 50)), 2),
            "p99": round(1e3 * float(np.percentile(ex, 99)), 2),
        }
    gaps = []
    for a, b in zip(win, win[1:]):
        if a[3]:  # the scheduler still had requests after step a
            gaps.append((b[0] - (a[0] + a[1]), a, b))
    if gaps:
        gaps.sort(key=lambda g: g[0], reverse=True)
        g, a, b = gaps[0]
        out["longest_gap_ms"] = round(1e3 * g, 2)
        out["longest_gap"] = {
            "at_s": round(a[0] + a[1] - lo, 3),
            "after_step": {"ms": round(1e3 * a[1], 2), "executed": a[2]},
            "before_step": {"ms": round(1e3 * b[1], 2), "executed": b[2]},
            "while_frozen": cont is not None and a[0] + a[1] < cont,
        }
        vals = [x[0] for x in gaps]
        out["gap_ms"] = {
            "p50": round(1e3 * float(np.percentile(vals, 50)), 3),
            "p99": round(1e3 * float(np.percentile(vals, 99)), 3),
            "top5": [round(1e3 * x, 2) for x in vals[:5]],
            "over_50ms": sum(1 for x in vals if x > 0.05),
        }
    return out


# ----------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------
def _pct(xs: list[float]) -> dict | None:
    if not xs:
        return None
    a = np.asarray(xs)
    return {
        "n": len(xs),
        "p50": round(float(np.percentile(a, 50)), 3),
        "p99": round(float(np.percentile(a, 99)), 3),
        "max": round(float(a.max()), 3),
    }


def _summary(rounds: list[dict]) -> dict:
    per: dict[str, dict] = {}
    for setting in ("calm", "frozen"):
        rs = [r for r in rounds if r["setting"] == setting]
        if not rs:
            continue
        inline = [x for r in rs for x in r["inline_latency_s"]]
        ref_ok = [x for r in rs for x in r["ref_latency_s"]["reference"]]
        ref_fail = [x for r in rs for x in r["ref_latency_s"]["RouteRefPublishError"]]
        loops = [r["step_loop"] for r in rs]
        gaps = [s for s in loops if "longest_gap_ms" in s]
        steps = [s for s in loops if "longest_step_ms" in s]
        per[setting] = {
            "rounds": len(rs),
            "inline_latency_s": _pct(inline),
            "inline_failed": sum(len(r["checks"]["inline_bad"]) for r in rs),
            "round_s": [r["round_s"] for r in rs],
            "ref_got_reference": sum(r["checks"]["ref_reference"] for r in rs),
            "ref_RouteRefPublishError": sum(
                r["checks"]["ref_RouteRefPublishError"] for r in rs
            ),
            "ref_other": sum(len(r["checks"]["ref_other"]) for r in rs),
            "ref_latency_s": {
                "reference": _pct(ref_ok),
                "RouteRefPublishError": _pct(ref_fail),
            },
            "refs_fetched_ok": sum(r["checks"]["fetched_ok"] for r in rs),
            "refs_fetch_bad": sum(len(r["checks"]["fetch_bad"]) for r in rs),
            "longest_step_ms": max((s["longest_step_ms"] for s in steps), default=None),
            "longest_step_ms_by_round": [s.get("longest_step_ms") for s in loops],
            "longest_gap_ms": max((s["longest_gap_ms"] for s in gaps), default=None),
            "longest_gap_ms_by_round": [s.get("longest_gap_ms") for s in loops],
            "gaps_over_50ms": sum(s["gap_ms"]["over_50ms"] for s in gaps),
        }
        if setting == "frozen":
            per[setting]["frozen_s"] = [r["frozen_s"] for r in rs]
            per[setting]["answered_while_frozen"] = [
                r["answered_while_frozen"] for r in rs
            ]
    out: dict = {"per_setting": per}
    if "calm" in per and "frozen" in per:
        c, f = per["calm"]["inline_latency_s"], per["frozen"]["inline_latency_s"]
        if c and f:
            out["inline_p99_frozen_over_calm"] = round(f["p99"] / c["p99"], 3)
            out["inline_p50_frozen_over_calm"] = round(f["p50"] / c["p50"], 3)
            out["goal_p99_within_1.2x"] = out["inline_p99_frozen_over_calm"] <= 1.2
        fg = per["frozen"]["longest_gap_ms"]
        out["goal_no_gap_over_50ms_frozen"] = fg is not None and fg <= 50.0
    return out


def _log_lines(limit: int = 40) -> dict:
    """Warnings and errors of the server log (distinct, shortened), and how
    often the reference transport's breaker or a publish error is named."""
    try:
        text = LOG.read_text(errors="replace")
    except OSError:
        return {}
    seen: dict[str, int] = {}
    for line in text.splitlines():
        if "WARNING" not in line and "ERROR" not in line:
            continue
        # Drop the timestamp prefix so repeats fold together.
        msg = line.split("] ", 1)[-1][:240]
        seen[msg] = seen.get(msg, 0) + 1
    return {
        "warnings_and_errors": [
            {"n": n, "msg": m} for m, n in list(seen.items())[:limit]
        ],
        "mentions_breaker_pause": text.count("calls are paused"),
        "mentions_RouteRefPublishError": text.count("RouteRefPublishError"),
    }


def _metrics(base_url: str) -> list[str]:
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return [repr(e)]
    keep = (
        "vllm:routed_experts_request_failures_total",
        "vllm:routed_experts_refs_published_total",
        "vllm:routed_experts_refs_waiting_bytes",
    )
    return [
        line
        for line in text.splitlines()
        if line.startswith(keep) and not line.rstrip().endswith(" 0.0")
    ]


def _listing(path: str) -> set[str]:
    try:
        return set(os.listdir(path))
    except OSError:
        return set()


def _git_head() -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


# ----------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------
def run(args) -> dict:
    from build_tiny_moe import build

    t_start = time.monotonic()
    before = {p: _listing(p) for p in ("/tmp", "/dev/shm", str(Path.home()))}
    result: dict = {
        "machine": {
            **machine_facts(),
            "git_head": _git_head(),
            "loadavg_start": os.getloadavg(),
        }
    }
    model = build(CACHE / "models" / "tiny-moe")
    cfg = json.loads((model / "config.json").read_text())
    layers, top_k = cfg["num_hidden_layers"], cfg["num_experts_per_tok"]

    shutil.rmtree(WORK, ignore_errors=True)
    (WORK / "boot").mkdir(parents=True)
    (WORK / "boot" / "sitecustomize.py").write_text(STEP_BOOT)
    steps_dir = WORK / "steps"
    steps_dir.mkdir()
    tmpdir = run_tmpdir("bench-iso")
    os.environ["TMPDIR"] = str(tmpdir)  # the master's and the consumer's
    shm_root = f"/dev/shm/vart-bench-iso-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    artifact = {
        "shm_root": shm_root,
        "ref_transport": "mooncake",
        "mooncake_segment_bytes": 64 << 20,
        "mooncake_buffer_bytes": 32 << 20,
        "ref_handoff_timeout_s": args.handoff_timeout_s,
    }
    master = server = consumer = None
    rounds: list[dict] = []
    try:
        started = start_master()
        if started is None:
            raise SystemExit("Mooncake is not installed (make setup installs it)")
        master, address = started
        artifact["mooncake_master"] = address
        flags = [
            "--served-model-name", MODEL_NAME, "--enable-routed-experts",
            "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
            "--max-model-len", "1024", "--max-num-seqs", str(args.max_num_seqs),
            "--enforce-eager", "--artifact-config", json.dumps(artifact),
            "--shutdown-timeout", "30",
        ]  # fmt: skip
        result["config"] = {
            "model": str(model.relative_to(ROOT)),
            "layers": layers,
            "top_k": top_k,
            "flags": flags,
            "requests_per_round": args.requests,
            "max_tokens": args.max_tokens,
            "rounds_per_setting": args.rounds,
            "freeze_s": args.freeze_s,
            "pause_s": args.pause_s,
        }
        server = Server(model, flags, steps_dir)
        result["startup_s"] = round(server.wait_healthy(args.startup_timeout_s), 1)
        consumer = Consumer(tmpdir)

        # Warm-up: both formats, one reference fetched.
        warm = [
            (f"{PROMPTS[i % len(PROMPTS)]} (warm-up {i})", "ref" if i % 2 else "inline")
            for i in range(8)
        ]
        w = _send_round(server.base_url, warm, args.max_tokens, None, 0, 120)
        result["warmup"] = _check_round(w, consumer, layers, top_k)
        time.sleep(args.pause_s)

        plan = [s for _ in range(args.rounds) for s in ("calm", "frozen")]
        for k, setting in enumerate(plan):
            jobs = [
                (
                    f"{PROMPTS[i % len(PROMPTS)]} (round {k}, request {i})",
                    "ref" if i % 2 else "inline",
                )
                for i in range(args.requests)
            ]
            rnd = _send_round(
                server.base_url,
                jobs,
                args.max_tokens,
                master if setting == "frozen" else None,
                args.freeze_s,
                args.request_timeout_s,
            )
            checks = _check_round(rnd, consumer, layers, top_k)
            done = [r for r in rnd["results"] if r is not None]
            row = {
                "round": k,
                "setting": setting,
                "round_s": round(rnd["last_answer"] - rnd["release"], 3),
                "unanswered": rnd["unanswered"],
                "inline_latency_s": [
                    round(r["latency_s"], 4) for r in done if r["fmt"] == "inline"
                ],
                "ref_latency_s": {
                    kind: [
                        round(r["latency_s"], 4)
                        for r in done
                        if r["fmt"] == "ref" and r.get("ref") == kind
                    ]
                    for kind in ("reference", "RouteRefPublishError")
                },
                "checks": checks,
                "_window": rnd,
            }
            if setting == "frozen":
                row["frozen_s"] = rnd["frozen_s"]
                row["answered_while_frozen"] = rnd["answered_while_frozen"]
            rounds.append(row)
            print(
                f"[bench] round {k} {setting}: {row['round_s']} s, inline p99 "
                f"{max(row['inline_latency_s'], default=0):.2f} s, refs "
                f"{checks['ref_reference']} / failed "
                f"{checks['ref_RouteRefPublishError']}",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(max(0.0, rnd["last_answer"] + args.pause_s - time.monotonic()))

        result["metrics"] = _metrics(server.base_url)
        recs = _read_steps(steps_dir)
        result["step_records"] = len(recs)
        for row in rounds:
            row["step_loop"] = _step_loop(recs, row.pop("_window"))
    finally:
        if consumer is not None:
            consumer.close()
        if server is not None:
            result["server_stop"] = server.stop()
        if master is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(master.pid, signal.SIGCONT)
            master.terminate()
            try:
                master.wait(timeout=30)
            except subprocess.TimeoutExpired:
                master.kill()
                master.wait(timeout=10)
        shm_left = os.path.exists(shm_root)
        shutil.rmtree(shm_root, ignore_errors=True)
        shutil.rmtree(tmpdir, ignore_errors=True)
    result["server_log"] = str(LOG.relative_to(ROOT))
    result["server_log_summary"] = _log_lines()
    shutil.rmtree(WORK, ignore_errors=True)
    result["summary"] = _summary(rounds)
    for row in rounds:  # the per-request latencies stay in the summary
        row["inline_latency_s"] = _pct(row["inline_latency_s"])
        row["ref_latency_s"] = {k: _pct(v) for k, v in row["ref_latency_s"].items()}
    result["rounds"] = rounds
    # New names in /tmp, /dev/shm and $HOME (another session's files show
    # here too: the machine is shared).
    result["leftovers"] = {
        "store_root_after_shutdown": shm_left,
        "new_entries": {
            p: sorted(_listing(p) - names)
            for p, names in before.items()
            if _listing(p) - names
        },
    }
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["total_s"] = round(time.monotonic() - t_start, 1)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each setting")
    ap.add_argument("--requests", type=int, default=32, help="per round")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--freeze-s", type=float, default=20.0)
    ap.add_argument("--pause-s", type=float, default=10.0)
    ap.add_argument("--handoff-timeout-s", type=float, default=5.0)
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--startup-timeout-s", type=float, default=300.0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    result = run(args)
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
