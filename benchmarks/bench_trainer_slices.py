# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trainer ranks reading their slices of a batch's routes against reading
whole arrays (issue 38), in one run. Prints JSON.

Shape: a batch of 64 references of 8,191 rows each (one rollout of 8,192
tokens: the last token has no row), Qwen3-30B-A3B's routes (48 decoder
layers, all MoE, top-8 of 128 experts, uint8; random expert IDs, seed 0),
3.1 MB of body per reference, 201 MB in all. Published as the engine does:
``RouteRefs.publish`` (``routes_format.encode``, then the host transport's
``put_readable``, or ``MooncakeRefSink.put`` = ``put_parts`` into the
engine's own segment of a Mooncake Store behind a real ``mooncake_master``
on 127.0.0.1, TCP), and ``RoutedExpertsRef.for_payload``.

Eight reader processes (spawned; they import neither vLLM nor, except for
``replay``, torch) stand for 4 pipeline stages x 2 data-parallel halves:
rank ``(stage, half)`` needs the references of its half (32) and the layers
of its stage (12, from ``routes_layers.moe_layers_of_stage``), as one
packed layer-major ``[12, 32 x 8,191, 8]`` array of dtype D. All 8 leave a
barrier together; a rank's time runs from the barrier until it holds that
array, the step's from the first rank's start until the last rank holds
it. Settings (the same output buffer each, allocated and touched once):

* ``sliced``: ``routes_reader.read_batch(refs, layers=stage, packed=True,
  layer_major=True, dtype=D, out=buf)``;
* ``whole``: ``fetch()`` of each whole reference (every layer, what a
  trainer does today), then its stage's layers copied and cast into buf;
* ``memcpy``: the same copy out of arrays the rank already holds in memory
  (the floor: no transport, no digest);
* ``replay``: ``megatron_replay.replay_inputs(refs, stage)`` (int64, THD,
  one token per row plus each sequence's last), end to end.

D is uint8 (the cast to int64 then happens on the device after the H2D
copy) and int64 (cast on the host). One warm-up round checks every
setting's output against the floor's; then ``--rounds`` timed rounds, the
settings interleaved (their order rotated each round).

Run: ``.venv/bin/python benchmarks/bench_trainer_slices.py`` (``--quick``:
8 references of 1,023 rows, 8 layers, 2 rounds; a smoke run).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent / "tools" / "cpu_harness")
)
from harness_env import apply_harness_env

apply_harness_env(enable_triton_interpreter=False)

import argparse
import json
import os
import statistics
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import xxhash
from machine import machine_facts
from mooncake_master import start_master

STAGES, HALVES = 4, 2
READERS = STAGES * HALVES
SEED = 0
#: Bounds every read: the settings measure speed, not the timeout.
TIMEOUT_S = 120.0
#: The readers' Mooncake client buffer: range reads go into registered
#: staging buffers of their own, so this only bounds each process's memory.
READER_MOONCAKE_BUFFER_BYTES = 16 << 20


@dataclass(frozen=True)
class Shape:
    refs: int
    rows: int
    layers: int
    top_k: int
    experts: int
    rounds: int

    def config(self) -> dict:
        """A Hugging Face config of the shape (Qwen3-MoE: every layer MoE)."""
        return {
            "model_type": "qwen3_moe",
            "num_hidden_layers": self.layers,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }


FULL = Shape(refs=64, rows=8191, layers=48, top_k=8, experts=128, rounds=5)
QUICK = Shape(refs=8, rows=1023, layers=8, top_k=8, experts=128, rounds=2)

#: (setting, D) per transport; the floor runs once per D.
READ_SETTINGS = [
    ("sliced", "uint8"),
    ("whole", "uint8"),
    ("sliced", "int64"),
    ("whole", "int64"),
    ("replay", "int64"),
]
FLOOR_SETTINGS = [("memcpy", "uint8"), ("memcpy", "int64")]


def routes(shape: Shape, i: int) -> np.ndarray:
    """Reference ``i``'s rows ``[rows, layers, top_k]`` (token-major, as the
    engine's route reader hands them to ``publish``)."""
    rng = np.random.default_rng([SEED, i])
    return rng.integers(
        0, shape.experts, (shape.rows, shape.layers, shape.top_k), dtype=np.uint8
    )


def digest(a: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(a.reshape(-1).view(np.uint8).data)


# ---------------------------------------------------------------- a rank
class Rank:
    """One trainer rank's inputs and the settings it runs."""

    def __init__(self, rank: int, shape: Shape, refs: dict[str, list[dict]]) -> None:
        from vllm_host_transport.routes_layers import moe_layers_of_stage

        self.stage, self.half = divmod(rank, HALVES)
        self.layers = moe_layers_of_stage(shape.config(), self.stage, STAGES)
        self.lo, self.hi = self.layers[0], self.layers[-1] + 1
        assert self.layers == list(range(self.lo, self.hi))
        mine = list(range(shape.refs))[self.half :: HALVES]
        self.refs = {t: r[self.half :: HALVES] for t, r in refs.items()}
        # The floor's source: this half's routes in memory, layer-major (as
        # stored), built from the same seed as the published ones.
        self.held = [
            np.ascontiguousarray(routes(shape, i).transpose(1, 0, 2)) for i in mine
        ]
        tokens = len(mine) * shape.rows
        self.out = {
            d: np.ones((len(self.layers), tokens, shape.top_k), d)  # touched
            for d in ("uint8", "int64")
        }
        self.expected: dict[str, str] = {}
        for d in self.out:
            self.memcpy(d)
            self.expected[d] = digest(self.out[d])

    def memcpy(self, dtype: str) -> Any:
        out, at = self.out[dtype], 0
        for body in self.held:
            n = body.shape[1]
            np.copyto(out[:, at : at + n], body[self.lo : self.hi])
            at += n
        return out

    def sliced(self, transport: str, dtype: str) -> Any:
        from vllm_host_transport.routes_reader import read_batch

        out, _ = read_batch(
            self.refs[transport],
            layers=self.layers,
            packed=True,
            layer_major=True,
            dtype=dtype,
            out=self.out[dtype],
            timeout_s=TIMEOUT_S,
        )
        return out

    def whole(self, transport: str, dtype: str) -> Any:
        from vllm_host_transport.routed_experts import fetch

        out, at = self.out[dtype], 0
        for ref in self.refs[transport]:
            a = fetch(ref, timeout_s=TIMEOUT_S)  # [rows, layers, top_k]
            n = a.shape[0]
            np.copyto(out[:, at : at + n], a[:, self.lo : self.hi].transpose(1, 0, 2))
            at += n
        return out

    def replay(self, transport: str, dtype: str) -> Any:
        from vllm_host_transport.megatron_replay import replay_inputs

        return replay_inputs(self.refs[transport], self.layers, timeout_s=TIMEOUT_S)

    def check(self, setting: str, dtype: str, got: Any) -> bool:
        if setting != "replay":
            return digest(got) == self.expected[dtype]
        # Token t of a sequence replays row t; its last token the row before.
        rows = self.held[0].shape[1]
        first = np.stack([t[: rows + 1].numpy() for t in got])
        want = self.held[0][self.lo : self.hi].astype(np.int64)
        return (
            len(got) == len(self.layers)
            and np.array_equal(first[:, :rows], want)
            and np.array_equal(first[:, rows], want[:, -1])
        )


def rank_main(rank: int, shape: Shape, refs: dict, barrier: Any, conn: Any) -> None:
    """A reader process: answers each ``(transport, setting, dtype, check)``
    with ``(start, end, bytes read, cpu seconds, ok)``; ``None`` ends it."""
    from vllm_host_transport.routes_reader import stats

    me = Rank(rank, shape, refs)
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        transport, setting, dtype, check = cmd
        run = getattr(me, setting)
        before, cpu = stats()["bytes_read"], time.process_time()
        barrier.wait()
        start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every rank
        got = run(dtype) if setting == "memcpy" else run(transport, dtype)
        end = time.monotonic()
        cpu = time.process_time() - cpu
        ok = me.check(setting, dtype, got) if check else True
        del got
        conn.send((start, end, stats()["bytes_read"] - before, cpu, ok))
    conn.close()


# ---------------------------------------------------------------- the driver
def publish(shape: Shape, master: str | None, scope: str) -> tuple[dict, list]:
    """Every reference of the batch on each transport, as the engine stores
    them; returns ``(refs by transport, the RouteRefs to close)``."""
    from vllm.config.artifact import ArtifactConfig
    from vllm.distributed.artifact_connector.route_refs import RouteRefs

    payload = shape.rows * shape.layers * shape.top_k + (64 << 10)
    total = shape.refs * payload
    sinks = {"host": RouteRefs(ArtifactConfig(ref_scope=scope, ref_max_bytes=total))}
    if master is not None:
        # The engine's own segment holds the batch, with room to spare for
        # Mooncake's allocator: 64 x 3.16 MB in 384 MiB.
        segment = max(64 << 20, -(-(total * 3 // 2) // (64 << 20)) * (64 << 20))
        sinks["mooncake"] = RouteRefs(
            ArtifactConfig(
                ref_transport="mooncake",
                mooncake_master=master,
                mooncake_segment_bytes=segment,
                mooncake_buffer_bytes=64 << 20,
                ref_max_bytes=total,
            )
        )
    refs: dict[str, list[dict]] = {t: [] for t in sinks}
    for i in range(shape.refs):
        rows = routes(shape, i)
        for transport, sink in sinks.items():
            refs[transport].append(sink.publish(rows, 0).to_json())
    return refs, list(sinks.values())


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def summarize(runs: list[list[tuple]]) -> dict:
    """One setting's rounds: ``runs[round][rank] = (start, end, bytes, cpu,
    ok)``."""
    steps = [max(r[1] for r in run) - min(r[0] for r in run) for run in runs]
    per_rank = [[run[k][1] - run[k][0] for run in runs] for k in range(READERS)]
    cpu = [sum(r[3] for r in run) for run in runs]
    # How far apart the ranks left the barrier (8 processes woken on 2 cores).
    skew = [max(r[0] for r in run) - min(r[0] for r in run) for run in runs]
    nbytes = [r[2] for run in runs for r in run]
    return {
        "bytes_per_rank": {"min": min(nbytes), "max": max(nbytes)},
        "step_s": spread(steps),
        "rank_s_median_by_rank": [statistics.median(v) for v in per_rank],
        "rank_s_max": max(max(v) for v in per_rank),
        "cpu_s_all_ranks": spread(cpu),
        "start_skew_s": spread(skew),
    }


def compare(res: dict, shape: Shape, headers: int) -> dict:
    """Against the issue's goals: each rank reads at most 1/4 of the bytes
    plus headers, the step's routes ready >= 4x sooner than whole arrays."""
    out: dict = {}
    per_half = shape.refs // HALVES
    body = per_half * shape.rows * shape.layers * shape.top_k
    for d in ("uint8", "int64"):
        s, w = res[f"sliced/{d}"], res[f"whole/{d}"]
        floor = res[f"memcpy/{d}"]["step_s"]["median"]
        out[d] = {
            "whole_over_sliced_step": w["step_s"]["median"] / s["step_s"]["median"],
            "bytes_whole_over_sliced": w["bytes_per_rank"]["max"]
            / s["bytes_per_rank"]["max"],
            "sliced_over_memcpy_step": s["step_s"]["median"] / floor,
            "whole_over_memcpy_step": w["step_s"]["median"] / floor,
            "sliced_bytes_at_most_quarter_plus_headers": s["bytes_per_rank"]["max"]
            <= body // STAGES + per_half * headers,
        }
    return out


def listing(path: str) -> set[str]:
    try:
        return set(os.listdir(path))
    except OSError:
        return set()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small shape (smoke)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--no-replay", action="store_true")
    args = ap.parse_args()
    shape = QUICK if args.quick else FULL
    if args.rounds is not None:
        shape = Shape(**{**asdict(shape), "rounds": args.rounds})
    import multiprocessing as mp

    # The readers' clients (and the driver's, for its release) inherit it.
    os.environ["VLLM_MOONCAKE_BUFFER_BYTES"] = str(READER_MOONCAKE_BUFFER_BYTES)
    body = shape.refs * shape.rows * shape.layers * shape.top_k
    shm = os.statvfs("/dev/shm")
    if shm.f_bavail * shm.f_frsize < 3 * body:
        raise SystemExit(f"/dev/shm has less than {3 * body} bytes free")
    tmp_before, shm_before = listing("/tmp"), listing("/dev/shm")
    result: dict = {
        "machine": machine_facts(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "load_start": os.getloadavg(),
        "shape": {**asdict(shape), "dtype": "uint8", "stages": STAGES},
        "readers": READERS,
    }
    started = None if args.no_mooncake else start_master()
    master = started[1] if started is not None else None
    if master is None:
        result["mooncake"] = "not run: " + (
            "--no-mooncake" if args.no_mooncake else "Mooncake is not installed"
        )
    scope = f"bench-slices-{uuid.uuid4().hex[:8]}"
    sinks: list = []
    scope_dir = ""
    procs: list = []
    conns: list = []
    try:
        t0 = time.monotonic()
        refs, sinks = publish(shape, master, scope)
        scope_dir = sinks[0]._sink._conn.scope_dir
        result["publish_s"] = time.monotonic() - t0
        result["header_nbytes"] = {t: r[0]["header_nbytes"] for t, r in refs.items()}
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(READERS)
        for rank in range(READERS):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(rank, shape, refs, barrier, child))
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        for c in conns:
            assert c.recv() == "ready"
        plan = [(t, s, d) for t in refs for s, d in READ_SETTINGS]
        plan += [("memory", s, d) for s, d in FLOOR_SETTINGS]
        if args.no_replay:
            plan = [p for p in plan if p[1] != "replay"]

        def step(item: tuple, check: bool) -> list[tuple]:
            for c in conns:
                c.send((*item, check))
            got = [c.recv() for c in conns]
            if check and not all(g[4] for g in got):
                raise SystemExit(f"{item}: a rank's output differs from the floor's")
            return got

        for item in plan:  # warm-up: joins, staging buffers; checks
            step(item, True)
        runs: dict[tuple, list] = {item: [] for item in plan}
        engine_cpu: dict[tuple, list] = {item: [] for item in plan}
        for r in range(shape.rounds):
            k = r % len(plan)
            for item in plan[k:] + plan[:k]:
                cpu = time.process_time()  # this process: Mooncake serving
                runs[item].append(step(item, False))
                engine_cpu[item].append(time.process_time() - cpu)
        for c in conns:
            c.send(None)
        for p in procs:
            p.join(120)
        floor = {
            f"{s}/{d}": summarize(runs[("memory", s, d)]) for s, d in FLOOR_SETTINGS
        }
        result["memory"] = floor
        for t in refs:
            res = {
                f"{s}/{d}": {
                    **summarize(runs[(t, s, d)]),
                    "engine_process_cpu_s": spread(engine_cpu[(t, s, d)]),
                }
                for s, d in READ_SETTINGS
                if (t, s, d) in runs
            }
            result[t] = {**res, "against_goals": compare(
                {**res, **floor}, shape, result["header_nbytes"][t]
            )}  # fmt: skip
        # The driver lets go of the batch: every payload removed now.
        from vllm_host_transport.routed_experts import close as close_clients
        from vllm_host_transport.routes_reader import release

        result["released"] = {
            t: release(r, timeout_s=TIMEOUT_S) for t, r in refs.items()
        }
        close_clients()  # while the master answers
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(30)
        for sink in sinks:
            sink.close()
        if started is not None:
            started[0].terminate()
            started[0].wait(timeout=30)
    result["load_end"] = os.getloadavg()
    # Names that appeared meanwhile (other processes' included; this
    # process's multiprocessing semaphores go at its exit): check after it.
    result["new_in_dev_shm"] = sorted(listing("/dev/shm") - shm_before)
    result["new_in_tmp"] = sorted(listing("/tmp") - tmp_before)
    result["scope_dir_left"] = os.path.exists(scope_dir)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
