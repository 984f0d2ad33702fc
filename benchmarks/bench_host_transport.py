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
* flood: an unbounded sender (no limit on messages in flight) at 4 KiB and
  64 KiB; messages/s and how many puts fell back to per-key segments.
* put/get cost: one process, put then get of the same key, each timed on its
  own (the send side's and the receive side's cost per message).
* fence: the cost of one call of the ring's memory fence on this CPU, and of
  a real fence instruction (C11 ``atomic_thread_fence`` from libatomic).

``--before DIR`` also runs every row with an earlier copy of the package,
importable from DIR as ``vllm_ht_before.host_transport`` (made with ``git
show <rev>:<file>`` per file and its imports of ``vllm_host_transport``
renamed; a revision from before the package moved to the top level names it
``vllm.distributed.host_transport``, and its ``vllm.distributed.safe_fs`` and
``vllm.distributed.process_identity`` are now ``vllm_host_transport.safe_fs``
and ``vllm_host_transport.process_identity``), interleaved with the current
code in the same run, so both columns share the machine's state.

Usage: python benchmarks/bench_host_transport.py [--iters 2000] [--out f.json]
       [--before .cache/ht_before]
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
import ctypes
import importlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

import vllm_host_transport as current_ht
from vllm_host_transport import ring as current_ring
from vllm_host_transport.discovery import hex_name

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


@dataclass
class Impl:
    """One implementation of the transport (the current code or an earlier
    copy) and the configuration options it knows."""

    name: str
    module: Any
    new_options: bool  # knows ring_wait_s, allowed_struct_types, ...
    extra: dict[str, Any] = field(default_factory=dict)

    def conn(self, ring: int, scope: str, **opts: Any) -> Any:
        if not self.new_options:
            opts = {}
        cfg = self.module.HostTransportConfig(host_ring_bytes=ring, scope=scope, **opts)
        return self.module.HostTransportConnector(cfg)


def load_impls(before_dir: str | None) -> list[Impl]:
    impls = [Impl("after", current_ht, True)]
    if before_dir:
        sys.path.insert(0, os.path.abspath(before_dir))
        before = importlib.import_module("vllm_ht_before.host_transport")
        impls.insert(0, Impl("before", before, False))
    return impls


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


_OPTS = {"allowed_struct_types": (Step,)}


def _receiver(impl, scope, ring, edge, label, n, shared, mode, out_q, ready, yield_cpu):
    # Same configuration as the sender: the per-key baseline is the same code
    # with the ring disabled at both ends.
    conn = impl.conn(ring, scope, **_OPTS)
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


def run_pair(
    impl: Impl, scope: str, ring: int, label: str, data: Any, n: int, mode: str
):
    """``mode``: "lat" (one message in flight), "tput" (up to 64 in flight) or
    "flood" (no limit: the sender never waits for the receiver)."""
    # A fresh edge (and so a fresh ring) for every run.
    edge = f"r-{label}-{mode}-{ring}-{uuid.uuid4().hex[:8]}"
    shared = CTX.RawArray("q", 1025)
    out_q = CTX.Queue()
    ready = CTX.Event()
    p = CTX.Process(
        target=_receiver,
        args=(impl, scope, ring, edge, label, n, shared, mode, out_q, ready, YIELD),
    )
    p.start()
    ready.wait(60)
    conn = impl.conn(ring, scope, **_OPTS)
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
        elif mode == "tput":
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


def _empty_poll_setup(impl: Impl, scope: str, ring: int) -> tuple[Any, Any]:
    """A producer with one payload out, and a receiver that has missed once
    (so its ring is attached and the next polls are the steady state)."""
    prod = impl.conn(ring, scope)
    prod.put("s", "r", "present", {"codes": torch.arange(4)})
    conn = impl.conn(ring, scope)
    conn.get("s", "r", "missing")
    return prod, conn


def empty_poll(impl: Impl, scope: str, ring: int, n: int) -> float:
    prod, conn = _empty_poll_setup(impl, scope, ring)
    get = conn.get
    t0 = time.perf_counter_ns()
    for _ in range(n):
        get("s", "r", "missing")
    dt = (time.perf_counter_ns() - t0) / max(n, 1)
    conn.close()
    prod.close()
    return dt


def _strace_calls(impl: Impl, ring: int, n: int) -> dict[str, Any] | None:
    """Attach ``strace -c`` to a child only while it runs ``n`` empty polls."""
    scope = f"bench-strace-{uuid.uuid4().hex}"
    out = os.path.join(os.environ.get("TMPDIR", "."), f"strace-{uuid.uuid4().hex}.txt")
    cmd = [
        sys.executable, __file__, "--empty-poll-child", str(n),
        "--ring", str(ring), "--scope", scope, "--impl", impl.name,
    ]  # fmt: skip
    if impl.name == "before":
        cmd += ["--before", os.path.dirname(os.path.dirname(impl.module.__path__[0]))]
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


def empty_poll_syscalls(impl: Impl, ring: int, n: int) -> dict[str, Any]:
    if shutil.which("strace") is None:
        return {"error": "strace not installed (apt-get install strace)"}
    res = _strace_calls(impl, ring, n)
    if res is None:
        return {"error": "could not parse strace -c output"}
    # The window also holds the child's read of "go" and write of its result.
    return {
        "polls": n,
        "syscalls_in_window": res["total"],
        "by_call": res["calls"],
        "syscalls_per_poll": round(res["total"] / n, 5),
    }


def fallback_put(impl: Impl, scope: str, data: Any, n: int) -> dict[str, Any]:
    # Ring full: fill a 4 MiB ring with unclaimed frames first (no wait for
    # space, no spilling: the fallback itself is measured).
    conn = impl.conn(RING, scope, ring_wait_s=0.0, ring_spill_age_s=3600.0)
    filler = {"codes": torch.arange(1000, dtype=torch.int64)}
    i = 0
    while conn.put("s", "r", f"fill{i}", filler)[2]["plane"] == "ring":
        i += 1
    plain = impl.conn(0, scope)
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


def put_get_cost(impl: Impl, scope: str, data: Any, n: int) -> dict[str, Any]:
    """Send and receive cost per message in one process (ring on): each put
    and the get that takes it, timed separately."""
    conn = impl.conn(RING, scope)
    put_us: list[float] = []
    get_us: list[float] = []
    for i in range(n):
        key = f"pg{i}"
        t0 = time.perf_counter_ns()
        conn.put("s", "pg", key, data)
        t1 = time.perf_counter_ns()
        r = conn.get("s", "pg", key)
        t2 = time.perf_counter_ns()
        if r is None:
            raise RuntimeError("get missed")
        put_us.append((t1 - t0) / 1000.0)
        get_us.append((t2 - t1) / 1000.0)
    conn.close()
    return {
        "put_p50_us": round(_pct(put_us, 0.5), 2),
        "get_p50_us": round(_pct(get_us, 0.5), 2),
    }


def fence_cost(n: int) -> dict[str, Any]:
    """ns per call: the ring's fence on this CPU, a real fence instruction
    (libatomic's atomic_thread_fence(seq_cst), as used off x86-64), and an
    empty loop for reference."""
    out: dict[str, Any] = {"machine": current_ring.platform.machine()}
    fences = {"ring_memory_fence": current_ring.memory_fence}
    try:
        real = ctypes.CDLL("libatomic.so.1").atomic_thread_fence
        real.restype = None
        real.argtypes = [ctypes.c_int]
        fences["libatomic_seq_cst_fence"] = lambda: real(5)
    except OSError:
        out["libatomic_seq_cst_fence"] = "libatomic.so.1 not found"
    fences["empty_loop"] = lambda: None
    for name, f in fences.items():
        t0 = time.perf_counter_ns()
        for _ in range(n):
            f()
        out[name + "_ns"] = round((time.perf_counter_ns() - t0) / n, 1)
    return out


def _empty_poll_child(impl: Impl, scope: str, ring: int, n: int) -> None:
    prod, conn = _empty_poll_setup(impl, scope, ring)
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
    ap.add_argument("--before", default=None, help="dir with vllm_ht_before/")
    ap.add_argument("--impl", default="after", help=argparse.SUPPRESS)
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

    impls = load_impls(args.before)
    if args.empty_poll_child is not None:
        impl = next(i for i in impls if i.name == args.impl)
        _empty_poll_child(impl, args.scope, args.ring, args.empty_poll_child)
        return

    run_id = uuid.uuid4().hex
    scopes = {impl.name: f"bench-{run_id}-{impl.name}" for impl in impls}
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
    turn = 0
    try:
        only = set(args.only.split(",")) if args.only else None
        for label, data in payloads().items():
            if only is not None and label not in only:
                continue
            big = label in ("512KiB", "quarter_ring+", "bf16_16x4096")
            n = max(200, args.iters // 4) if big else args.iters
            row: dict[str, Any] = {impl.name: {} for impl in impls}
            for mode_name, ring in (("ring", RING), ("perkey", 0)):
                for kind, mode in (("latency", "lat"), ("throughput", "tput")):
                    # Interleaved, one run each, the order alternating from
                    # one pair to the next (the second of a pair can land on
                    # a differently loaded machine).
                    turn += 1
                    for impl in impls if turn % 2 else impls[::-1]:
                        row[impl.name].setdefault(mode_name, {})[kind] = run_pair(
                            impl, scopes[impl.name], ring, label, data, n, mode
                        )
            for impl in impls:
                r = row[impl.name]
                r50 = r["ring"]["latency"]["p50_us"]
                k50 = r["perkey"]["latency"]["p50_us"]
                r["p50_speedup"] = round(k50 / r50, 1)
                print(
                    f"# {label} {impl.name}: ring p50 {r50} us, per-key p50 {k50} "
                    f"us, ring {r['ring']['throughput']['msgs_per_s']} msgs/s",
                    file=sys.stderr,
                )
            result["results"][label] = row
        if args.skip_extras:
            return _finish(result, args)
        flood: dict[str, Any] = {}
        for label in ("4KiB", "64KiB"):
            data = payloads()[label]
            flood[label] = {impl.name: {} for impl in impls}
            for mode_name, ring in (("ring", RING), ("perkey", 0)):
                turn += 1
                for impl in impls if turn % 2 else impls[::-1]:
                    res = run_pair(
                        impl, scopes[impl.name], ring, label, data, args.iters, "flood"
                    )
                    flood[label][impl.name][mode_name] = res
                    print(
                        f"# flood {label} {impl.name} {mode_name}: "
                        f"{res['msgs_per_s']} msgs/s, fallbacks {res['fallbacks']}",
                        file=sys.stderr,
                    )
        result["flood"] = flood
        # Three rounds, alternating which implementation goes first; the
        # median of the rounds' p50s.
        result["put_get_cost"] = {}
        for label in ("4KiB", "64KiB"):
            rounds: dict[str, list[dict[str, Any]]] = {i.name: [] for i in impls}
            for rnd in range(3):
                for impl in impls if rnd % 2 == 0 else impls[::-1]:
                    rounds[impl.name].append(
                        put_get_cost(
                            impl, scopes[impl.name], payloads()[label], args.iters
                        )
                    )
            result["put_get_cost"][label] = {
                name: {
                    k: sorted(r[k] for r in rs)[1] for k in ("put_p50_us", "get_p50_us")
                }
                for name, rs in rounds.items()
            }
        result["fence"] = fence_cost(args.polls)
        result["empty_poll"] = {
            impl.name: {
                "ring_ns": round(
                    empty_poll(impl, scopes[impl.name], RING, args.polls), 1
                ),
                "perkey_ns": round(
                    empty_poll(impl, scopes[impl.name], 0, args.polls), 1
                ),
                "ring_syscalls": empty_poll_syscalls(impl, RING, 100000),
                "perkey_syscalls": empty_poll_syscalls(impl, 0, 100000),
            }
            for impl in impls
        }
        result["fallback_put_4KiB"] = {
            impl.name: fallback_put(
                impl, scopes[impl.name], payloads()["4KiB"], min(args.iters, 1000)
            )
            for impl in impls
        }
    finally:
        for scope in scopes.values():
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
