# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What ``backend: mooncake`` costs the publication thread, against the
``/dev/shm`` store alone, in one run. Prints JSON.

Shape: Qwen3-30B-A3B's routes (48 layers, top-8, uint8) in blocks of 16
rows: 6,208-byte objects. Two step shapes: a prefill step of 8k tokens (512
objects, 3.2 MB) and a decode step at 256 running requests (16 blocks
complete). A real ``mooncake_master`` on 127.0.0.1 (TCP), started here.

* ``put``: ``put_batch`` of new objects through ``ShmStoreWriter`` alone
  (``local``) and through ``SharedTierWriter`` (``shared``: the same put,
  plus the mirror's one batched Mooncake upsert), the fill copying prepared
  objects as the publisher's encoder does;
* ``pull``: a second engine's ``SharedTierWriter`` (its own client and
  local store) pulling the keys the first one published, which it lacks,
  as before a hit on another engine's KV is taken: objects fetched in one
  batched read on the tier's thread and verified, put into its local store
  by the caller's (the publication) thread; against ``local_lookup``, a
  lookup of the objects once local, and ``memcpy``, one copy of the bytes;
  ``local_present``: what the scheduler (``ExternalHits``) reads on the
  engine thread before it takes such a hit, the local store's index;
* ``mac``: the authenticator of the same objects (keyed BLAKE2b of name,
  header and bytes), which the mirror computes on the tier's thread and the
  pull checks there (it is inside ``pull``; ``mac_share_of_pull``).

Medians over ``--reps`` repetitions (fresh keys each time).

Run: ``.venv/bin/python benchmarks/bench_shared_tier.py``
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
import platform
import statistics
import threading
import time
import uuid

import numpy as np
from mooncake_master import start_master

from vllm.config.artifact import ArtifactConfig
from vllm.config.artifact_transfer import SHARED_SECRET_ENV
from vllm.distributed.artifact_connector.mooncake import client as mc
from vllm.distributed.artifact_connector.mooncake.objects import mac_key, object_mac
from vllm.distributed.artifact_connector.mooncake.tiered import SharedTierWriter
from vllm.distributed.artifact_connector.shm import ShmStoreReader, ShmStoreWriter
from vllm.distributed.artifact_connector.store import checksum

OBJECT_NBYTES = 16 * 48 * 8 + 64


def objects(n: int, rng) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    keys = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(n)]
    data = rng.integers(0, 128, n * OBJECT_NBYTES, dtype=np.uint8)
    lengths = np.full(n, OBJECT_NBYTES, np.int64)
    sums = np.fromiter(
        (checksum(data[i * OBJECT_NBYTES : (i + 1) * OBJECT_NBYTES]) for i in range(n)),
        np.uint64,
        n,
    )
    return keys, lengths, data, sums


def put_s(writer, keys, lengths, data, sums) -> float:
    def fill(buf):
        buf[:] = data
        return sums

    mirrored = isinstance(writer, SharedTierWriter)
    before = _mirror_count(writer) if mirrored else 0
    t = time.perf_counter()
    writer.put_batch(keys, lengths, fill)
    if mirrored:  # the mirror runs on the tier's thread: time it landing
        while _mirror_count(writer) < before + len(keys):
            time.sleep(0)
    return time.perf_counter() - t


def _mirror_count(writer) -> int:
    st = writer.stats()
    return st.shared_puts + st.shared_failures


def writer_pair(root: str, master: str):
    cfg = ArtifactConfig(
        backend="mooncake",
        key_space="bench",
        mooncake_master=master,
        mooncake_segment_bytes=1 << 30,
        mooncake_buffer_bytes=64 << 20,
        shared_pull_timeout_s=10.0,  # time the pulls, never their deadline
    )
    # The key space's deployment secret (both writers are given it).
    os.environ.setdefault(SHARED_SECRET_ENV, "the benchmark's key space secret")
    out = []
    for seg in (None, 256 << 20):  # two clients: the pull crosses the transport
        client = mc.acquire(cfg, segment_bytes=seg)
        namespace = uuid.uuid4().hex
        local = ShmStoreWriter(root, namespace, capacity_bytes=2 << 30)
        out.append(
            SharedTierWriter(local, cfg, max_object_nbytes=OBJECT_NBYTES, client=client)
        )
    return out, namespace  # b's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    started = start_master()
    if started is None:
        raise SystemExit("Mooncake is not installed (make setup installs it)")
    master, address = started
    root = f"/dev/shm/bench-shared-tier-{os.getpid()}"
    rng = np.random.default_rng(0)
    result: dict = {
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "load_start": os.getloadavg(),
        "object_bytes": OBJECT_NBYTES,
    }
    local = ShmStoreWriter(root, uuid.uuid4().hex, capacity_bytes=2 << 30)
    (a, b), b_namespace = writer_pair(root, address)
    b_reader = ShmStoreReader(root, b_namespace)
    try:
        for name, n in (("prefill_8k", 512), ("decode_256", 16)):
            runs = []
            for _ in range(args.reps):
                keys, lengths, data, sums = objects(n, rng)
                r = {"local_put_s": put_s(local, keys, lengths, data, sums)}
                keys, lengths, data, sums = objects(n, rng)
                r["shared_put_s"] = put_s(a, keys, lengths, data, sums)
                t = time.perf_counter()
                ended = threading.Event()
                assert not b.pull("bench", keys, ended.set)
                assert ended.wait(30) and b.pulled() == ["bench"]
                r["pull_s"] = time.perf_counter() - t
                t = time.perf_counter()
                present = b_reader.num_present(keys)
                r["local_present_s"] = time.perf_counter() - t
                assert present == n, "pull lost objects"
                t = time.perf_counter()
                b.lookup(keys)
                r["local_lookup_s"] = time.perf_counter() - t
                out = np.empty_like(data)
                t = time.perf_counter()
                np.copyto(out, data)
                r["memcpy_s"] = time.perf_counter() - t
                # The authenticator of n objects, as the mirror (on the tier's
                # thread) computes it and a pull checks it.
                mk, mv, signed = mac_key(b"bench secret"), data.data, bytes(16)
                t = time.perf_counter()
                for i, k in enumerate(keys):
                    object_mac(
                        mk, k, signed, mv[i * OBJECT_NBYTES : (i + 1) * OBJECT_NBYTES]
                    )
                r["mac_s"] = time.perf_counter() - t
                runs.append(r)
            med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
            med["objects"] = n
            med["shared_put_over_local_put"] = med["shared_put_s"] / med["local_put_s"]
            med["pull_us_per_object"] = med["pull_s"] / n * 1e6
            med["pull_over_memcpy"] = med["pull_s"] / med["memcpy_s"]
            med["mac_us_per_object"] = med["mac_s"] / n * 1e6
            med["mac_share_of_pull"] = med["mac_s"] / med["pull_s"]
            result[name] = med
        result["counters_a"] = {
            k: getattr(a.stats(), k) for k in ("shared_puts", "shared_failures")
        }
        result["counters_b"] = {"shared_pulls": b.stats().shared_pulls}
    finally:
        b_reader.close()
        for w in (local, a, b):
            w.close()
        if os.path.isdir(root):
            os.rmdir(root)
        master.terminate()
        master.wait(timeout=30)
    result["load_end"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
