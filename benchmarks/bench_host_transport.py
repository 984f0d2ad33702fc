# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host transport benchmark: the host ring versus the per-key path.

Same connector code and serializer in both modes; only ``host_ring_bytes``
differs (4 MiB vs 0). Prints one JSON document.

* latency: put-to-owned-object, one message in flight, a real second process
  receives (busy-polling ``get``); p50/p99 in microseconds.
* throughput: messages/s with up to 64 messages in flight.
* payloads: ``{"codes": int64 tensor}`` of 256 B, 4 KiB, 64 KiB, 512 KiB and
  just above a quarter of the ring (falls back to per-key segments); a typed
  struct with a few small tensors; a bfloat16 [16, 4096] hidden state.
* empty poll: cost of ``get`` on a key that is not there (ring attached), and
  its system calls counted with ``strace -c`` (difference of two runs).
* fallback put: cost of a put while the ring is full, against a plain per-key
  put of the same payload.

Usage: python benchmarks/bench_host_transport.py [--iters 2000] [--out f.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Keep every cache and temporary file of this run under the repository's
# .cache/ (importing torch/vllm would otherwise write to /tmp).
sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent / "tools" / "cpu_harness")
)
from harness_env import apply_harness_env

apply_harness_env(enable_triton_interpreter=False)

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import time
import uuid
from typing import Any

import msgspec
import torch

from vllm.distributed.host_transport import (
    HostTransportConfig,
    HostTransportConnector,
)
from vllm.distributed.host_transport.discovery import hex_name

RING = 4 << 20
CTX = mp.get_context("fork")
# Busy-wait loops yield the CPU (sched_yield) between polls: on a 2-vCPU
# machine shared with other work, two pure spinners otherwise hand off at
# scheduler-tick granularity (milliseconds). Set by --no-yield.
YIELD = True


class Step(msgspec.Struct):
    request_id: str
    step: int
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    routed_experts: torch.Tensor
    finished: bool = False


def payloads() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, n in (
        ("256B", 256),
        ("4KiB", 4096),
        ("64KiB", 64 << 10),
        ("512KiB", 512 << 10),
        ("quarter_ring+", RING // 4 + 4096),
    ):
        out[label] = {"codes": torch.arange(n // 8, dtype=torch.int64)}
    out["typed_struct"] = Step(
        "req-1",
        3,
        torch.arange(16, dtype=torch.int64),
        torch.randn(16, 8),
        torch.randint(0, 64, (16, 8), dtype=torch.int32),
    )
    out["bf16_16x4096"] = {"hidden": torch.randn(16, 4096).to(torch.bfloat16)}
    return out


def scope_dir(scope: str) -> str:
    return f"/dev/shm/vllm-ht-{os.getuid()}-{hex_name(scope)}"


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def _receiver(scope, ring, edge, label, n, shared, mode, out_q, ready, yield_cpu):
    # Same configuration as the sender: the per-key baseline is the same code
    # with the ring disabled at both ends.
    conn = HostTransportConnector(
        HostTransportConfig(host_ring_bytes=ring, scope=scope)
    )
    lat = []
    ready.set()
    t_first = t_last = 0
    for i in range(n):
        key = f"{label}-{mode}-{i}"
        give_up = time.monotonic() + 60
        while True:
            r = conn.get("s", edge, key)
            if r is not None:
                break
            if yield_cpu:
                os.sched_yield()
            if time.monotonic() > give_up:
                raise RuntimeError(f"receiver: {key} never arrived")
        t1 = time.perf_counter_ns()
        obj = r[0]
        del obj
        if i == 0:
            t_first = t1
        t_last = t1
        if mode == "lat":
            lat.append((t1 - shared[i % 1024]) / 1000.0)
        shared[1024] = i + 1  # ack
    conn.close()
    out_q.put((lat, t_first, t_last))


def run_pair(scope: str, ring: int, label: str, data: Any, n: int, mode: str):
    # A fresh edge (and so a fresh ring) for every run.
    edge = f"r-{label}-{mode}-{ring}-{uuid.uuid4().hex[:8]}"
    shared = CTX.RawArray("q", 1025)
    out_q = CTX.Queue()
    ready = CTX.Event()
    p = CTX.Process(
        target=_receiver,
        args=(scope, ring, edge, label, n, shared, mode, out_q, ready, YIELD),
    )
    p.start()
    ready.wait(60)
    conn = HostTransportConnector(
        HostTransportConfig(host_ring_bytes=ring, scope=scope)
    )
    planes: dict[str, int] = {}
    t_start = time.perf_counter_ns()
    yield_cpu = YIELD
    for i in range(n):
        key = f"{label}-{mode}-{i}"
        if mode == "lat":
            while shared[1024] != i:
                if yield_cpu:
                    os.sched_yield()
            shared[i % 1024] = time.perf_counter_ns()
        else:
            while i - shared[1024] >= 64:
                if yield_cpu:
                    os.sched_yield()
        ok, _, desc = conn.put("s", edge, key, data)
        if not ok:
            raise RuntimeError("put failed")
        planes[desc["plane"]] = planes.get(desc["plane"], 0) + 1
    lat, _t_first, t_last = out_q.get(timeout=600)
    p.join(60)
    health = conn.health()
    conn.close()
    res: dict[str, Any] = {"n": n, "planes": planes}
    if mode == "lat":
        res.update(p50_us=round(_pct(lat, 0.5), 2), p99_us=round(_pct(lat, 0.99), 2))
    else:
        res["msgs_per_s"] = round(n / ((t_last - t_start) / 1e9))
    res["fallbacks"] = health["fallbacks"]
    return res


def _empty_poll_setup(
    scope: str, ring: int
) -> tuple[HostTransportConnector, HostTransportConnector]:
    """A producer with one payload out, and a receiver that has missed once
    (so its ring is attached and the next polls are the steady state)."""
    prod = HostTransportConnector(
        HostTransportConfig(host_ring_bytes=ring, scope=scope)
    )
    prod.put("s", "r", "present", {"codes": torch.arange(4)})
    conn = HostTransportConnector(
        HostTransportConfig(host_ring_bytes=ring, scope=scope)
    )
    conn.get("s", "r", "missing")
    return prod, conn


def empty_poll(scope: str, ring: int, n: int) -> float:
    prod, conn = _empty_poll_setup(scope, ring)
    get = conn.get
    t0 = time.perf_counter_ns()
    for _ in range(n):
        get("s", "r", "missing")
    dt = (time.perf_counter_ns() - t0) / max(n, 1)
    conn.close()
    prod.close()
    return dt


def _strace_calls(ring: int, n: int) -> dict[str, Any] | None:
    """Attach ``strace -c`` to a child only while it runs ``n`` empty polls."""
    scope = f"bench-strace-{uuid.uuid4().hex}"
    out = os.path.join(os.environ.get("TMPDIR", "."), f"strace-{uuid.uuid4().hex}.txt")
    cmd = [
        sys.executable, __file__, "--empty-poll-child", str(n),
        "--ring", str(ring), "--scope", scope,
    ]  # fmt: skip
    child = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        if child.stdout.readline().strip() != "ready":
            return None
        tracer = subprocess.Popen(
            ["strace", "-c", "-p", str(child.pid), "-o", out],
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # let strace attach
        child.stdin.write("go\n")
        child.stdin.flush()
        line = child.stdout.readline().strip()
        tracer.send_signal(signal.SIGINT)
        tracer.wait(60)
        child.stdin.write("exit\n")
        child.stdin.flush()
        child.wait(60)
        with open(out) as f:
            text = f.read()
    finally:
        if child.poll() is None:
            child.kill()
        shutil.rmtree(scope_dir(scope), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(out)
    total = None
    per_call: dict[str, int] = {}
    for row in text.splitlines():
        tok = row.split()
        if len(tok) >= 5 and tok[-1] == "total":
            total = int(tok[3])
        elif len(tok) >= 5 and tok[0][0].isdigit() and tok[3].isdigit():
            per_call[tok[-1]] = int(tok[3])
    if total is None:
        return None
    return {"loop_ns_per_poll": float(line or 0), "total": total, "calls": per_call}


def empty_poll_syscalls(ring: int, n: int) -> dict[str, Any]:
    if shutil.which("strace") is None:
        return {"error": "strace not installed (apt-get install strace)"}
    res = _strace_calls(ring, n)
    if res is None:
        return {"error": "could not parse strace -c output"}
    # The window also holds the child's read of "go" and write of its result.
    return {
        "polls": n,
        "syscalls_in_window": res["total"],
        "by_call": res["calls"],
        "syscalls_per_poll": round(res["total"] / n, 5),
    }


def fallback_put(scope: str, data: Any, n: int) -> dict[str, Any]:
    # Ring full: fill a 4 MiB ring with unclaimed frames first.
    conn = HostTransportConnector(
        HostTransportConfig(host_ring_bytes=RING, scope=scope)
    )
    filler = {"codes": torch.arange(1000, dtype=torch.int64)}
    i = 0
    while conn.put("s", "r", f"fill{i}", filler)[2]["plane"] == "ring":
        i += 1
    plain = HostTransportConnector(HostTransportConfig(host_ring_bytes=0, scope=scope))
    out: dict[str, Any] = {"ring_fill_frames": i}
    # Interleaved (alternating which goes first), so neither side profits
    # from warm-up or pays for a directory the other one filled.
    pairs = (("fallback_put_ring_full", conn), ("plain_perkey_put", plain))
    times: dict[str, list[float]] = {name: [] for name, _ in pairs}
    for j in range(n):
        for name, c in pairs if j % 2 == 0 else pairs[::-1]:
            t0 = time.perf_counter_ns()
            ok, _, desc = c.put("s", "r", f"{name}{j}", data)
            times[name].append((time.perf_counter_ns() - t0) / 1000.0)
            if not ok or desc["plane"] != "key":
                raise RuntimeError("expected a per-key put")
            # Retire it again so the directory does not grow during the run.
            c.cleanup(f"{name}{j}")
    for name, _ in pairs:
        out[name] = {
            "p50_us": round(_pct(times[name], 0.5), 2),
            "p99_us": round(_pct(times[name], 0.99), 2),
        }
    conn.cleanup_prefix("fill")
    conn.close()
    plain.close()
    return out


def _empty_poll_child(scope: str, ring: int, n: int) -> None:
    prod, conn = _empty_poll_setup(scope, ring)
    get = conn.get
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        get("s", "r", "missing")
    dt = (time.perf_counter_ns() - t0) / n
    print(f"{dt:.1f}", flush=True)
    sys.stdin.readline()
    conn.close()
    prod.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--polls", type=int, default=200000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--empty-poll-child", type=int, default=None)
    ap.add_argument("--ring", type=int, default=RING)
    ap.add_argument("--scope", default=None)
    ap.add_argument("--no-yield", action="store_true")
    ap.add_argument(
        "--only", default=None, help="comma-separated payload labels to run"
    )
    ap.add_argument(
        "--skip-extras",
        action="store_true",
        help="skip the empty-poll, strace and fallback-put sections",
    )
    args = ap.parse_args()
    global YIELD
    YIELD = not args.no_yield

    if args.empty_poll_child is not None:
        _empty_poll_child(args.scope, args.ring, args.empty_poll_child)
        return

    scope = f"bench-{uuid.uuid4().hex}"
    result: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
            "python": sys.version.split()[0],
            "spin_yield": YIELD,
            "torch": torch.__version__,
        },
        "ring_bytes": RING,
        "payload_note": "{'codes': int64 tensor} unless named otherwise",
        "results": {},
    }
    try:
        only = set(args.only.split(",")) if args.only else None
        for label, data in payloads().items():
            if only is not None and label not in only:
                continue
            big = label in ("512KiB", "quarter_ring+", "bf16_16x4096")
            n = max(200, args.iters // 4) if big else args.iters
            row: dict[str, Any] = {}
            for mode_name, ring in (("ring", RING), ("perkey", 0)):
                row[mode_name] = {
                    "latency": run_pair(scope, ring, label, data, n, "lat"),
                    "throughput": run_pair(scope, ring, label, data, n, "tput"),
                }
            r50 = row["ring"]["latency"]["p50_us"]
            k50 = row["perkey"]["latency"]["p50_us"]
            row["p50_speedup"] = round(k50 / r50, 1)
            result["results"][label] = row
            print(
                f"# {label}: ring p50 {r50} us, per-key p50 {k50} us", file=sys.stderr
            )
        if args.skip_extras:
            return _finish(result, args)
        result["empty_poll"] = {
            "ring_ns": round(empty_poll(scope, RING, args.polls), 1),
            "perkey_ns": round(empty_poll(scope, 0, args.polls), 1),
            "ring_syscalls": empty_poll_syscalls(RING, 100000),
            "perkey_syscalls": empty_poll_syscalls(0, 100000),
        }
        result["fallback_put_4KiB"] = fallback_put(
            scope, payloads()["4KiB"], min(args.iters, 1000)
        )
    finally:
        shutil.rmtree(scope_dir(scope), ignore_errors=True)
    _finish(result, args)


def _finish(result: dict[str, Any], args: argparse.Namespace) -> None:
    result["machine"]["loadavg_end"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
