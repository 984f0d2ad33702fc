# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark of the artifact core in the shapes the engine has. Prints JSON.

Model shape: 48 layers, 128 experts, top-8 (uint8 rows of 384 B); hash
blocks of 16 tokens (one object: 6 KiB of rows + a 64 B envelope); 256
running requests. Everything runs through the worker's real path
(``ArtifactPublisher``: row slab, publication thread, ``/dev/shm`` store)
and the scheduler's real read path (``read_rows``), and each figure is set
against copying the same bytes with numpy, measured in the same run:

* ``decode_step``: one decode step of 256 requests in which 16 of them
  complete a block at unrelated rows. Calling-thread time of handing the
  step over (``flush``), of buffering its 256 rows (``write_step``), and
  the publication thread's CPU time per step (its thread CPU clock, over
  many steps), for the engine's path (full blocks gathered over a few
  steps) and, as the baseline, one work item every step.
* ``mixed_step``: an 8k-token prefill chunk (512 blocks) plus 255 decodes.
* ``materialise_*``: reading back a finished 32k-token request (2048
  objects, 12 MiB: checksums, envelopes, copy), published as prefill chunks
  (adjacent) or one block per step among 15 other requests (interleaved).
* ``finish_batch``: a step in which 256 requests finish together (RL
  rollouts of one ``max_tokens``), their objects published one block per
  step. Engine-thread time of today's path (one ``read_rows`` per request
  on the engine thread, the baseline), of one ``read_batch`` of all of
  them, and of handing them to the ``RouteReader`` (``submit`` plus
  ``take_done``); the time until the reader has every array; the longest
  gap of a ticking engine-thread loop while the reader works (what the
  interpreter lock costs it), against the same loop alone. Shapes: 256
  requests of 128 rows, 64 of 2,048, one of 32,768 (read in runs).
* ``reader_mappings``: reading back a finished 8k- and 32k-token request
  whose rows span one and four arenas, with the reader keeping all, the
  newest or none of them mapped between reads (``shm/reader.py``: none
  while ``/dev/shm`` is tight, all otherwise).
* ``stall``: the worst and 99.9th-percentile calling-thread time of a step
  over 10,000 steps (write + flush; a 1 ms sleep stands in for the GPU)
  while arenas are started and evicted, the log is compacted and stale
  stores of dead writers are collected.

Run: ``.venv/bin/python benchmarks/bench_artifact_store.py``
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
import hashlib
import json
import os
import platform
import shutil
import statistics
import time
import uuid

import numpy as np

from vllm.distributed.artifact_connector.buffer import RowSlab
from vllm.distributed.artifact_connector.protocol import (
    ArtifactSchedulerMeta,
    AttemptStart,
    BlockHashes,
    Finalize,
    Release,
)
from vllm.distributed.artifact_connector.publisher import (
    GATHER_OBJECTS,
    ArtifactPublisher,
)
from vllm.distributed.artifact_connector.request_core import (
    KeySpace,
    RowsRead,
    read_batch,
    read_rows,
)
from vllm.distributed.artifact_connector.route_reader import RouteRead, RouteReader
from vllm.distributed.artifact_connector.route_results import RouteResults
from vllm.distributed.artifact_connector.shm import (
    ShmStoreReader,
    ShmStoreWriter,
    make_namespace,
)
from vllm.distributed.artifact_connector.store import checksum
from vllm.utils.routed_experts_rows import RowSpec

LAYERS, EXPERTS, TOP_K, B = 48, 128, 8, 16
SPEC = RowSpec.for_experts(LAYERS, TOP_K, EXPERTS)
RUNNING = 256


def bh(req: str, b: int) -> bytes:
    return hashlib.sha256(f"{req}/{b}".encode()).digest()


def rows_for(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(
        0, EXPERTS, (n, LAYERS, TOP_K), np.uint8
    )


def copy_time(nbytes: int, reps: int = 50) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Engine:
    """The worker side as the engine drives it, on a real store."""

    def __init__(self, root: str, capacity: int, arena: int | None = None, **kw):
        ns = make_namespace("bench", uuid.uuid4().hex)
        self.writer = ShmStoreWriter(
            root, ns, capacity_bytes=capacity, arena_bytes=arena, **kw
        )
        self.slab = RowSlab.for_scheduler(
            SPEC,
            B,
            max_num_seqs=RUNNING,
            max_num_batched_tokens=8192,
            steps_in_flight=4,
            gathered_pages=GATHER_OBJECTS,
        )
        self.pub = ArtifactPublisher(self.writer, SPEC, self.slab, KeySpace(ns))
        self.root, self.ns = root, ns
        self.pos: dict[str, int] = {}
        self.hashed: dict[str, int] = {}
        self.handle: dict[str, int] = {}

    def start(self, reqs: list[str]) -> None:
        self.pub.apply(
            ArtifactSchedulerMeta(starts=tuple(AttemptStart(r, 0, 0) for r in reqs))
        )
        for r in reqs:
            self.pos[r] = 0
            self.hashed[r] = 0
            self.handle[r] = int(self.pub.current_attempts([r])[0])

    def step_inputs(self, counts: dict[str, int]) -> tuple:
        """Scheduler messages (hashes of blocks these rows complete) and the
        rows of one step."""
        hashes = []
        for r, n in counts.items():
            end = self.pos[r] + n
            nb = end // B
            if nb > self.hashed[r]:
                hashes.append(
                    BlockHashes(
                        r,
                        0,
                        self.hashed[r],
                        tuple(bh(r, b) for b in range(self.hashed[r], nb)),
                    )
                )
                self.hashed[r] = nb
        attempts = np.array([self.handle[r] for r in counts], np.int64)
        starts = [self.pos[r] for r in counts]
        for r, n in counts.items():
            self.pos[r] += n
        rows = rows_for(len(counts), sum(counts.values()))
        return (
            ArtifactSchedulerMeta(hashes=tuple(hashes)),
            attempts,
            starts,
            list(counts.values()),
            rows,
        )

    def prefill(self, reqs: list[str], lengths: list[int]) -> None:
        """Start ``reqs`` with ``lengths[i]`` rows already buffered (so that
        their blocks complete at staggered steps)."""
        self.start(reqs)
        for i, (r, n) in enumerate(zip(reqs, lengths)):
            self.pos[r] = n
            self.pub.write_step(np.array([self.handle[r]]), [0], [n], rows_for(i, n))

    def timed_step(
        self, counts: dict[str, int], gather: bool = True
    ) -> tuple[ArtifactSchedulerMeta, float, float]:
        """One step: messages, then the timed ``write_step`` and ``flush``
        (``gather`` as the engine's step passes it). Returns the messages
        and the two calling-thread times."""
        meta, att, st, cnt, rows = self.step_inputs(counts)
        self.pub.apply(meta)
        t0 = time.perf_counter()
        self.pub.write_step(att, st, cnt, rows)
        t1 = time.perf_counter()
        self.pub.flush(gather=gather)
        return meta, t1 - t0, time.perf_counter() - t1

    def close(self) -> None:
        self.pub.close()


def count_thread_cpu(pub: ArtifactPublisher) -> list[int]:
    """Accumulate the publication thread's CPU time spent on work items
    (``PublicationThread._process``; the idle upkeep is not counted) into the
    returned list's single element, in nanoseconds. Benchmark-side
    instrumentation."""
    total = [0]
    process = pub._publication._process

    def timed(work):
        t0 = time.thread_time_ns()
        process(work)
        total[0] += time.thread_time_ns() - t0

    pub._publication._process = timed  # type: ignore[method-assign]
    return total


def decode_counts(step: int) -> dict[str, int]:
    return {f"d{i}": 1 for i in range(RUNNING)}


def bench_decode_step(root: str, steps: int) -> dict:
    """Per step, the engine's path (full blocks gathered over up to
    ``GATHER_STEPS`` steps) against one work item every step, in the same
    run; the publication thread's CPU time is its whole thread's (work items,
    upkeep, wake-ups), as the engine's process pays it."""
    out: dict = {}
    for path, gather in (("gathered", True), ("every_step", False)):
        eng = Engine(root, 8 << 30)
        reqs = [f"d{i}" for i in range(RUNNING)]
        # Staggered so that 16 of the 256 complete a block per step.
        eng.prefill(reqs, [i % B + 1 for i in range(RUNNING)])
        eng.pub.flush()
        eng.pub.wait_idle(60)
        flush_t, write_t, blocks = [], [], []
        clock = time.pthread_getcpuclockid(eng.pub._publication._thread.ident)  # type: ignore[arg-type]
        cpu0 = time.clock_gettime(clock)
        for s in range(steps):
            meta, w, f = eng.timed_step(decode_counts(s), gather)
            write_t.append(w)
            flush_t.append(f)
            blocks.append(len(meta.hashes))
            eng.pub.report()
            time.sleep(0.002)  # the GPU step: the thread publishes meanwhile
        eng.pub.flush()
        eng.pub.wait_idle(60)
        pub_cpu = time.clock_gettime(clock) - cpu0
        eng.close()
        per_step_blocks = statistics.fmean(blocks)
        nbytes = int(per_step_blocks * B * SPEC.row_nbytes)
        base = copy_time(nbytes)
        pub_step = pub_cpu / steps
        out[path] = {
            "blocks_per_step": per_step_blocks,
            "bytes_per_step": nbytes,
            "flush_us_median": statistics.median(flush_t) * 1e6,
            "flush_us_mean": statistics.fmean(flush_t) * 1e6,
            "flush_us_p99": float(np.percentile(flush_t, 99)) * 1e6,
            "write_step_256_rows_us_median": statistics.median(write_t) * 1e6,
            "publication_thread_cpu_us_per_step": pub_step * 1e6,
            "copy_us": base * 1e6,
            "publication_cpu_over_copy": pub_step / base,
        }
    out["thread_cpu_gathered_over_every_step"] = (
        out["gathered"]["publication_thread_cpu_us_per_step"]
        / out["every_step"]["publication_thread_cpu_us_per_step"]
    )
    return out


def bench_mixed_step(root: str, steps: int) -> dict:
    eng = Engine(root, 8 << 30)
    dec = [f"d{i}" for i in range(RUNNING - 1)]
    eng.prefill(dec, [i % B + 1 for i in range(RUNNING - 1)])
    flush_t, write_t = [], []
    cpu = count_thread_cpu(eng.pub)
    for s in range(steps):
        pre = f"p{s}"
        eng.start([pre])
        _, w, f = eng.timed_step({pre: 8192, **{r: 1 for r in dec}})
        write_t.append(w)
        flush_t.append(f)
        eng.pub.wait_idle(60)  # one chunk per step, measured alone
        eng.pub.apply(ArtifactSchedulerMeta(finalizes=(Finalize(pre, 0, 8192),)))
        eng.pub.flush()
        eng.pub.wait_idle(60)
        eng.pub.apply(ArtifactSchedulerMeta(releases=(Release(pre, 0),)))
        eng.pub.report()
    pub_cpu = cpu[0] / 1e9
    eng.close()
    nbytes = (8192 + RUNNING - 1) * SPEC.row_nbytes
    base = copy_time(nbytes, 20)
    return {
        "rows_per_step": 8192 + RUNNING - 1,
        "flush_us_median": statistics.median(flush_t) * 1e6,
        "write_step_us_median": statistics.median(write_t) * 1e6,
        "publication_cpu_ms_per_step": pub_cpu / steps * 1e3,
        "copy_ms": base * 1e3,
        "publication_cpu_over_copy": pub_cpu / steps / base,
    }


def publish_request(eng: Engine, tokens: int, layout: str) -> tuple:
    """Publish a finished ``tokens``-row request; returns its ack."""
    me = "me"
    if layout == "prefill":
        eng.start([me])
        for _ in range(0, tokens, 8192):
            meta, att, st, cnt, rows = eng.step_inputs({me: 8192})
            eng.pub.apply(meta)
            eng.pub.write_step(att, st, cnt, rows)
            eng.pub.flush()
    else:
        others = [f"o{i}" for i in range(15)]
        eng.start([me, *others])
        for _ in range(0, tokens, B):
            meta, att, st, cnt, rows = eng.step_inputs({r: B for r in [me, *others]})
            eng.pub.apply(meta)
            eng.pub.write_step(att, st, cnt, rows)
            eng.pub.flush()
    eng.pub.apply(ArtifactSchedulerMeta(finalizes=(Finalize(me, 0, tokens),)))
    eng.pub.flush()
    eng.pub.wait_idle(120)
    (ack,) = [a for a in eng.pub.report().acks if a.req_id == me]
    return ack


def bench_materialise(root: str, layout: str, reps: int) -> dict:
    tokens = 32768
    eng = Engine(root, 8 << 30)
    ack = publish_request(eng, tokens, layout)
    reader = ShmStoreReader(root, eng.ns)
    out = np.empty((tokens, LAYERS, TOP_K), np.uint8)
    read_rows(reader, SPEC, ack.refs, tokens, out=out)  # maps the arenas
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        read_rows(reader, SPEC, ack.refs, tokens, out=out)
        times.append(time.perf_counter() - t0)
    # The checksums alone, over the same mapped bytes.
    idx = reader._index
    slots = reader._locate(ack.refs.keys, ack.refs.checksums).tolist()
    views = [
        reader._arena(int(idx.arena[s])).mv[
            int(idx.off[s]) : int(idx.off[s] + idx.length[s])
        ]
        for s in slots
    ]
    t0 = time.perf_counter()
    for v in views:
        checksum(v)
    hash_t = time.perf_counter() - t0
    views.clear()
    reader.close()
    eng.close()
    nbytes = tokens * SPEC.row_nbytes
    base = copy_time(nbytes, 20)
    t = statistics.median(times)
    return {
        "objects": len(ack.refs),
        "bytes": nbytes,
        "ms": t * 1e3,
        "copy_ms": base * 1e3,
        "over_copy": t / base,
        "checksum_share": hash_t / t,
    }


def bench_reader_mappings(root: str, reps: int) -> dict:
    """A finished request's rows read back where they span several arenas
    (published as 8k-token prefill chunks: an arena each), with the reader
    keeping every arena mapped between reads (``/dev/shm`` roomy), or, as
    on a tight ``/dev/shm``, only the newest (``KEEP_MAPPED_WHEN_TIGHT`` 1,
    the earlier rule) or none (0, with its log closed, today's rule); the
    three take turns, rep by rep."""
    from vllm.distributed.artifact_connector.shm import reader as reader_mod

    policies = {"keep_all": (0, 0), "keep_1": (1 << 50, 1), "keep_0": (1 << 50, 0)}
    saved = reader_mod.TIGHT_ARENAS, reader_mod.KEEP_MAPPED_WHEN_TIGHT
    result = {}
    try:
        for tokens in (8192, 32768):
            eng = Engine(root, 256 << 20, 2 << 20)
            ack = publish_request(eng, tokens, "prefill")
            reader = ShmStoreReader(root, eng.ns)
            out = np.empty((tokens, LAYERS, TOP_K), np.uint8)
            times: dict[str, list[float]] = {p: [] for p in policies}
            for _ in range(reps):
                for name, (tight, keep) in policies.items():
                    reader_mod.TIGHT_ARENAS, reader_mod.KEEP_MAPPED_WHEN_TIGHT = (
                        tight,
                        keep,
                    )
                    # What this policy leaves mapped after a read.
                    read_rows(reader, SPEC, ack.refs, tokens, out=out)
                    t0 = time.perf_counter()
                    read_rows(reader, SPEC, ack.refs, tokens, out=out)
                    times[name].append(time.perf_counter() - t0)
            idx = reader._index
            slots = reader._locate(ack.refs.keys, ack.refs.checksums)
            arenas = len(set(idx.arena[slots].tolist()))
            reader.close()
            eng.close()
            med = {p: statistics.median(t) for p, t in times.items()}
            result[f"{tokens}_tokens"] = {
                "bytes": tokens * SPEC.row_nbytes,
                "arenas": arenas,
                **{f"{p}_ms": t * 1e3 for p, t in med.items()},
                "keep_1_over_keep_all": med["keep_1"] / med["keep_all"],
                "keep_0_over_keep_all": med["keep_0"] / med["keep_all"],
            }
    finally:
        reader_mod.TIGHT_ARENAS, reader_mod.KEEP_MAPPED_WHEN_TIGHT = saved
    return result


def publish_finished(eng: Engine, n: int, rows: int) -> list:
    """``n`` requests of ``rows`` rows, one block per step each (their
    objects interleave), finalised together; returns their acks."""
    reqs = [f"f{i}" for i in range(n)]
    eng.start(reqs)
    for _ in range(0, rows, B):
        meta, att, st, cnt, rr = eng.step_inputs(
            {r: min(B, rows - eng.pos[r]) for r in reqs}
        )
        eng.pub.apply(meta)
        eng.pub.write_step(att, st, cnt, rr)
        eng.pub.flush()
    eng.pub.apply(
        ArtifactSchedulerMeta(finalizes=tuple(Finalize(r, 0, rows) for r in reqs))
    )
    eng.pub.flush()
    eng.pub.wait_idle(300)
    acks = [a for a in eng.pub.report().acks if a.req_id in set(reqs)]
    assert len(acks) == n
    return acks


def _ticks(stop, gaps: list[float]) -> None:
    """The engine thread's stand-in: short Python work, then 0.2 ms
    waits, recording the longest time between two ticks."""
    last = time.perf_counter()
    while not stop():
        sum(range(50))
        time.sleep(0.0002)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def bench_finish_batch(root: str, n: int, rows: int, reps: int) -> dict:
    eng = Engine(root, 8 << 30)
    acks = publish_finished(eng, n, rows)
    reader = ShmStoreReader(root, eng.ns)
    reads = [RowsRead(a.refs, a.num_rows) for a in acks]
    read_batch(reader, SPEC, reads)  # maps the arenas
    per_request, batched = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for a in acks:
            read_rows(reader, SPEC, a.refs, a.num_rows)
        per_request.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        read_batch(reader, SPEC, reads)
        batched.append(time.perf_counter() - t0)
    results = RouteResults()
    route_reader = RouteReader(reader, SPEC, results)
    jobs = [RouteRead(a.req_id, 1, r, a.num_rows) for a, r in zip(acks, reads)]
    engine_s, done_s, worst_gap, p99_gap = [], [], [], []
    for _ in range(reps):
        gaps: list[float] = []
        t0 = time.perf_counter()
        route_reader.submit(jobs)
        spent = time.perf_counter() - t0
        got = 0
        last = time.perf_counter()
        while got < n:
            time.sleep(0.0002)
            now = time.perf_counter()
            gaps.append(now - last)
            t1 = time.perf_counter()
            got += len(results.take())
            last = time.perf_counter()
            spent += last - t1
        done_s.append(time.perf_counter() - t0)
        engine_s.append(spent)
        worst_gap.append(max(gaps))
        p99_gap.append(float(np.percentile(gaps, 99)))
    route_reader.close()  # closes the reader too
    alone: list[float] = []
    t_end = time.perf_counter() + statistics.median(done_s) * reps
    _ticks(lambda: time.perf_counter() > t_end, alone)
    eng.close()
    nbytes = n * rows * SPEC.row_nbytes
    base = copy_time(nbytes, 20)
    med = statistics.median
    return {
        "requests": n,
        "rows_each": rows,
        "objects": sum(len(a.refs) for a in acks),
        "bytes": nbytes,
        "copy_ms": base * 1e3,
        "engine_thread_ms": {
            "read_rows_per_request": med(per_request) * 1e3,
            "read_batch": med(batched) * 1e3,
            "route_reader": med(engine_s) * 1e3,
        },
        "route_reader_all_done_ms": med(done_s) * 1e3,
        "tick_gap_ms": {
            "with_reader_max": max(worst_gap) * 1e3,
            "with_reader_p99": med(p99_gap) * 1e3,
            "alone_max": max(alone) * 1e3,
            "alone_p99": float(np.percentile(alone, 99)) * 1e3,
        },
    }


def plant_dead_store(root: str) -> None:
    ns = make_namespace("dead", uuid.uuid4().hex)
    path = os.path.join(root, ns)
    os.mkdir(path, 0o700)
    fd = os.open(os.path.join(path, "writer.json"), os.O_WRONLY | os.O_CREAT, 0o600)
    rec = {"format": 2, "pid": 2**22 + 1, "start_ticks": 1, "boot_id": "", "pid_ns": 0}
    os.write(fd, json.dumps(rec).encode())
    os.close(fd)
    for i in range(8):
        fd = os.open(
            os.path.join(path, f"{i:016x}.arena"), os.O_WRONLY | os.O_CREAT, 0o600
        )
        os.posix_fallocate(fd, 0, 1 << 20)
        os.close(fd)


def bench_stall(root: str, steps: int) -> dict:
    # A small store (64 MiB, arenas of 4 MiB): arenas are started ahead and
    # evicted all the time and the log is compacted; a dead writer's store
    # is planted every 1,000 steps and collected (collection runs every
    # second). Requests finish at 256 tokens and are replaced, so finished
    # requests' objects become evictable once the scheduler releases them.
    eng = Engine(root, 64 << 20, 4 << 20, collect_interval_s=1.0)
    slots = [f"d{i}" for i in range(RUNNING)]
    # Staggered: about one request finishes per step.
    eng.prefill(slots, [i + 1 for i in range(RUNNING)])
    step_t = []
    acks = 0
    release: list[Release] = []
    generation = 0
    for s in range(steps):
        if s % 1000 == 0:
            plant_dead_store(root)
        meta, att, st, cnt, rows = eng.step_inputs({r: 1 for r in slots})
        finishing = [r for r in slots if eng.pos[r] >= 256]
        fins = tuple(
            Finalize(r, 0, eng.pos[r]) for r in finishing if eng.pos[r] % B == 0
        )
        meta = ArtifactSchedulerMeta(
            hashes=meta.hashes, finalizes=fins, releases=tuple(release)
        )
        release = []
        t0 = time.perf_counter()
        eng.pub.apply(meta)
        eng.pub.write_step(att, st, cnt, rows)
        eng.pub.flush()
        rep = eng.pub.report()
        step_t.append(time.perf_counter() - t0)
        if rep.failures:
            raise RuntimeError(rep.failures[0].message)
        for ack in rep.acks:
            acks += 1
            release.append(Release(ack.req_id, ack.attempt))
        # Finished requests leave; new ones take their slots next step.
        for f in fins:
            slots.remove(f.req_id)
            generation += 1
            new = f"g{generation}"
            slots.append(new)
            eng.start([new])
        time.sleep(0.001)
    eng.pub.wait_idle(60)
    stats = eng.writer.stats()
    eng.close()
    return {
        "steps": steps,
        "max_ms": max(step_t) * 1e3,
        "p999_ms": float(np.percentile(step_t, 99.9)) * 1e3,
        "median_us": statistics.median(step_t) * 1e6,
        "requests_finished": acks,
        "arenas_started": stats.arenas_started,
        "arenas_started_on_demand": stats.arenas_started_on_demand,
        "evicted_objects": stats.evicted_objects,
        "relocated_objects": stats.relocated_objects,
        "log_compactions": stats.log_compactions,
        "stores_collected": stats.stores_collected,
    }


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="decode steps measured")
    ap.add_argument("--stall-steps", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=20, help="materialisation repetitions")
    ap.add_argument("--only", nargs="*", default=None, help="run only these parts")
    args = ap.parse_args()
    root = f"/dev/shm/vllm-bench-artifacts-{os.getpid()}"
    result: dict = {
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "load_start": os.getloadavg(),
    }
    parts = {
        "decode_step": lambda: bench_decode_step(root, args.steps),
        "mixed_step": lambda: bench_mixed_step(root, 20),
        "materialise_prefill_layout": lambda: bench_materialise(
            root, "prefill", args.reps
        ),
        "materialise_interleaved": lambda: bench_materialise(
            root, "interleaved", args.reps
        ),
        "finish_batch": lambda: {
            f"{n}x{rows}": bench_finish_batch(root, n, rows, 5)
            for n, rows in ((256, 128), (64, 2048), (1, 32768))
        },
        "stall": lambda: bench_stall(root, args.stall_steps),
        "reader_mappings": lambda: bench_reader_mappings(root, args.reps),
    }
    try:
        for name, fn in parts.items():
            if args.only is None or name in args.only:
                result[name] = fn()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["load_end"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
