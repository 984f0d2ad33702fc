# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a slow or frozen shared tier costs inline requests (r5 M2). Prints
JSON.

One real ``vllm serve`` of the tiny Qwen3-MoE on the CPU harness (the server,
requests and helpers of ``bench_r3_isolation.py``), ``--enable-routed-experts``
with ``backend: mooncake`` against a real ``mooncake_master`` on 127.0.0.1
(TCP), and vLLM's ``ExampleConnector`` as ``kv_both`` (a shared KV pool: the
role whose finished requests' acknowledgements wait for their objects'
mirrors). Every request is inline, with a prompt new in every round, so every
finishing request mirrors new objects into the tier.

Rounds cycle ``healthy``, ``slow`` and ``frozen`` (``--rounds`` of each). A
round releases ``--requests`` (32) concurrent ``/v1/completions`` (8 new
tokens, greedy, ``ignore_eos``) at once. ``slow``: while the round runs, the
master is stopped (``SIGSTOP``) for a time drawn uniformly from 0.2-0.6 s,
continued for 10 ms, stopped again, and so on: every call into the tier
waits up to 0.6 s, and most calls stay within ``shared_pull_timeout_s``
(1 s), so the breaker does not trip. ``frozen``: the master is stopped for
the whole round, at most ``--freeze-s`` (20 s). A round is followed by a
pause of ``--pause-s`` (10 s: the tier's breaker pauses calls for up to
8 s). Reported per setting, pooled over its rounds: throughput (requests
answered per second of round), latency p50/p99/max, requests that failed,
and the ratios against ``healthy`` (goals: slow throughput within 5%,
frozen p99 within 1.2x); and the settle counters from ``/metrics``.

Run (from the repository root, under the engine lock of the shared
machine): ``flock .cache/engine.lock .venv/bin/python
benchmarks/bench_slow_tier.py [--rounds 2] [--out FILE]``
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
import uuid  # noqa: E402

import bench_r3_isolation as iso  # noqa: E402  (sets the harness env first)
from harness_env import CACHE, run_tmpdir  # noqa: E402
from machine import machine_facts  # noqa: E402
from mooncake_master import start_master  # noqa: E402

WORK = CACHE / "bench-slow-tier"
iso.WORK = WORK
iso.LOG = CACHE / "logs" / "bench-slow-tier-serve.log"
COUNTERS = (
    "store_shared_settles_total",
    "store_shared_settles_late_total",
    "store_shared_failures_total",
    "store_shared_published_objects_total",
)


class DutyCycle:
    """Stops and continues the master while it runs: a slow master."""

    def __init__(self, pid: int, seed: int) -> None:
        self._pid = pid
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            os.kill(self._pid, signal.SIGSTOP)
            try:
                self._stop.wait(self._rng.uniform(0.2, 0.6))
            finally:
                os.kill(self._pid, signal.SIGCONT)
            self._stop.wait(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        os.kill(self._pid, signal.SIGCONT)


def _settles(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in COUNTERS:
            if line.startswith(f"vllm:routed_experts_{name}"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _round(server, master, setting: str, n: int, r: int, args) -> dict:
    jobs = [
        (f"{iso.PROMPTS[i % len(iso.PROMPTS)]} ({setting} {r}.{i})", "inline")
        for i in range(n)
    ]
    slow = DutyCycle(master.pid, seed=r) if setting == "slow" else None
    try:
        out = iso._send_round(
            server.base_url, jobs, args.max_tokens,
            master if setting == "frozen" else None, args.freeze_s,
            args.request_timeout_s,
        )  # fmt: skip
    finally:
        if slow is not None:
            slow.stop()
    done = [x for x in out["results"] if x is not None]
    ok = [x for x in done if x["status"] == 200 and x["body"]["choices"][0].get(
        "routed_experts") is not None]  # fmt: skip
    span = out["last_answer"] - out["release"]
    return {
        "setting": setting,
        "round_s": round(span, 3),
        "answered": len(done),
        "ok": len(ok),
        "failed": [x["body"] for x in done if x not in ok][:3],
        "latency_s": [x["latency_s"] for x in done],
        "throughput_rps": round(len(ok) / span, 3) if span > 0 else None,
    }


def run(args) -> dict:
    from build_tiny_moe import build

    result: dict = {"machine": {**machine_facts(), "git_head": iso._git_head()}}
    model = build(CACHE / "models" / "tiny-moe")
    shutil.rmtree(WORK, ignore_errors=True)
    (WORK / "boot").mkdir(parents=True)
    (WORK / "boot" / "sitecustomize.py").write_text(iso.STEP_BOOT)
    steps_dir = WORK / "steps"
    steps_dir.mkdir()
    kv_pool = WORK / "kv-pool"
    kv_pool.mkdir()
    secret = WORK / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    tmpdir = run_tmpdir("bench-slow-tier")
    os.environ["TMPDIR"] = str(tmpdir)
    shm_root = f"/dev/shm/vart-bench-slow-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    master = server = None
    rounds: list[dict] = []
    try:
        started = start_master()
        if started is None:
            raise SystemExit("Mooncake is not installed (make setup installs it)")
        master, address = started
        artifact = {
            "shm_root": shm_root, "backend": "mooncake", "key_space": "bench-slow",
            "mooncake_master": address, "mooncake_segment_bytes": 64 << 20,
            "mooncake_buffer_bytes": 16 << 20, "shared_secret_file": str(secret),
        }  # fmt: skip
        kv = {
            "kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(kv_pool)},
        }  # fmt: skip
        flags = [
            "--served-model-name", iso.MODEL_NAME, "--enable-routed-experts",
            "--dtype", "float32", "--block-size", str(iso.BLOCK_SIZE),
            "--max-model-len", "1024", "--max-num-seqs", str(args.max_num_seqs),
            "--enforce-eager", "--artifact-config", json.dumps(artifact),
            "--kv-transfer-config", json.dumps(kv), "--shutdown-timeout", "30",
        ]  # fmt: skip
        result["config"] = {"flags": flags, "requests_per_round": args.requests,
                            "max_tokens": args.max_tokens, "rounds": args.rounds,
                            "freeze_s": args.freeze_s}  # fmt: skip
        server = iso.Server(model, flags, steps_dir)
        result["startup_s"] = round(server.wait_healthy(args.startup_timeout_s), 1)
        iso._send_round(server.base_url, [(f"warm-up {i}", "inline") for i in range(8)],
                        args.max_tokens, None, 0.0, args.request_timeout_s)  # fmt: skip
        time.sleep(2)
        for r in range(args.rounds):
            for setting in ("healthy", "slow", "frozen"):
                rounds.append(_round(server, master, setting, args.requests, r, args))
                time.sleep(args.pause_s)
        result["metrics"] = _settles(server.base_url)
    finally:
        if server is not None:
            result["server_stop"] = server.stop()
        if master is not None:
            os.kill(master.pid, signal.SIGCONT)
            master.terminate()
            master.wait(timeout=30)
        shutil.rmtree(shm_root, ignore_errors=True)
        shutil.rmtree(tmpdir, ignore_errors=True)
        shutil.rmtree(WORK, ignore_errors=True)
    per: dict[str, dict] = {}
    for setting in ("healthy", "slow", "frozen"):
        rs = [x for x in rounds if x["setting"] == setting]
        lat = [v for x in rs for v in x["latency_s"]]
        tput = [x["throughput_rps"] for x in rs if x["throughput_rps"]]
        per[setting] = {
            "rounds": len(rs),
            "throughput_rps": round(sum(tput) / len(tput), 3) if tput else None,
            "latency_s": iso._pct(lat),
            "failed": sum(x["answered"] - x["ok"] for x in rs),
            "unanswered": sum(args.requests - x["answered"] for x in rs),
            "round_s": [x["round_s"] for x in rs],
            "failures_seen": [f for x in rs for f in x["failed"]][:3],
        }
    h = per["healthy"]
    if h["throughput_rps"] and per["slow"]["throughput_rps"]:
        result["slow_throughput_vs_healthy"] = round(
            per["slow"]["throughput_rps"] / h["throughput_rps"], 3
        )
    if h["latency_s"] and per["frozen"]["latency_s"]:
        result["frozen_p99_vs_healthy"] = round(
            per["frozen"]["latency_s"]["p99"] / h["latency_s"]["p99"], 3
        )
    result["settings"] = per
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each setting")
    ap.add_argument("--requests", type=int, default=32, help="per round")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--freeze-s", type=float, default=20.0)
    ap.add_argument("--pause-s", type=float, default=10.0)
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--startup-timeout-s", type=float, default=300.0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    result = run(args)
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
