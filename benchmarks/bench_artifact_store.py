# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark of the artifact store's /dev/shm backend. Prints JSON.

Model shape: 48 layers, 128 experts, top-8 -> uint8 rows of 384 bytes;
hash blocks of 16 tokens (one object = 16 rows = 6 KiB + 64 B envelope).

Measured in one run, each against a plain numpy copy of the same number of
row bytes (``np.copyto``) in the same process:

* publication (encode + batched put) of one decode step's objects
  (``--decode-batch`` running requests, so batch/16 blocks complete per step)
  and of one 8k-token prefill chunk (512 objects);
* materialisation of a 32k-token request (2048 objects, 12 MiB) from
  another process, checksums verified, for two layouts: published as four
  8k prefill chunks, and published one block per batch interleaved with
  other requests' blocks (decode-heavy worst case);
* the checksum's share of the materialisation time.

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
import subprocess
import time
import uuid

import numpy as np

from vllm.distributed.artifact_connector.request_core import (
    KeySpace,
    RowSpec,
    plan_coverage,
    publish_rows,
    read_request,
)
from vllm.distributed.artifact_connector.shm import ShmObjectStore, make_namespace
from vllm.distributed.artifact_connector.store import checksum_function

LAYERS, EXPERTS, TOP_K, BLOCK = 48, 128, 8, 16
SPEC = RowSpec.for_experts(LAYERS, TOP_K, EXPERTS)
KS = KeySpace("bench", "w0")


def block_hashes(req: int, n: int) -> list[bytes]:
    return [hashlib.sha256(b"%d-%d" % (req, b)).digest() for b in range(n)]


def rows_for(req: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(req)
    return rng.integers(0, EXPERTS, (n, LAYERS, TOP_K), dtype=np.uint8)


def timeit(fn, reps: int) -> float:
    return timeit_stats(fn, reps)[0]


def timeit_stats(fn, reps: int) -> tuple[float, float]:
    """(median, mean) of ``reps`` timed calls after one warm-up call. The
    mean includes the occasional call that starts (allocates and maps) a
    fresh arena; the median is the steady state."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), statistics.fmean(times)


def memcpy_baseline(nbytes: int, reps: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return timeit(lambda: np.copyto(dst, src), reps)


def reader_main(args: argparse.Namespace) -> None:
    store = ShmObjectStore.open_reader(args.root, args.namespace)
    num_rows = args.tokens
    out = {}
    for layout, req in (("prefill_chunks", 1), ("decode_interleaved", 2)):
        hashes = block_hashes(req, num_rows // BLOCK)
        segs = plan_coverage(KS, BLOCK, num_rows, hashes)
        expect = rows_for(req, num_rows)
        got = read_request(store, SPEC, segs, num_rows)
        if not np.array_equal(got, expect):
            raise SystemExit("materialised rows differ from the published rows")
        keys = [s.key for s in segs]
        t_mat = timeit(lambda s=segs: read_request(store, SPEC, s, num_rows), args.reps)
        batch = store.get_batch(keys)
        fn = checksum_function(store.checksum_algorithm)
        mv = batch.data.data
        offs, lens = batch.offsets.tolist(), batch.lengths.tolist()
        ends = [o + ln for o, ln in zip(offs, lens)]

        def checksums(mv=mv, offs=offs, ends=ends, fn=fn):
            # The same per-object hashing the read path does, on a copy.
            return list(map(fn, map(mv.__getitem__, map(slice, offs, ends))))

        t_sum = timeit(checksums, args.reps)
        out[layout] = {"seconds": t_mat, "checksum_seconds": t_sum}
    base = memcpy_baseline(num_rows * SPEC.row_nbytes, args.reps)
    out["memcpy_seconds"] = base
    store.close()
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--decode-batch", type=int, default=256)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--amortise-chunks",
        type=int,
        default=64,
        help="prefill chunks published back to back for the amortised figure",
    )
    p.add_argument("--role", default="main", help=argparse.SUPPRESS)
    p.add_argument("--root", default="", help=argparse.SUPPRESS)
    p.add_argument("--namespace", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "reader":
        reader_main(args)
        return

    root = f"/dev/shm/vllm-bench-artifacts-{uuid.uuid4().hex[:8]}"
    store = ShmObjectStore.create(root, make_namespace("bench"), capacity_bytes=2 << 30)
    try:
        result: dict[str, object] = {
            "shape": {
                "layers": LAYERS,
                "experts": EXPERTS,
                "top_k": TOP_K,
                "dtype": str(SPEC.dtype),
                "row_bytes": SPEC.row_nbytes,
                "hash_block_tokens": BLOCK,
            },
            "checksum": store.checksum_algorithm.name,
            "load_average_at_start": os.getloadavg(),
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
            },
        }
        # --- publication: one decode step (batch/16 blocks complete) -------
        n_dec = max(1, args.decode_batch // BLOCK)
        dec_rows = rows_for(7, n_dec * BLOCK)
        step = [0]
        # Block hashes come from the engine (the prefix cache computed them);
        # generate them before timing so that only publication is measured.
        dec_hashes = [block_hashes(1000 + i, n_dec) for i in range(args.reps + 2)]

        def publish_decode():
            step[0] += 1
            # Each completed block belongs to another request: new keys.
            publish_rows(store, KS, SPEC, BLOCK, 0, dec_rows, dec_hashes[step[0]])

        t_dec, m_dec = timeit_stats(publish_decode, args.reps)
        b_dec = memcpy_baseline(dec_rows.nbytes, args.reps)
        # --- publication: one 8k prefill chunk --------------------------------
        pre_rows = rows_for(8, args.prefill_tokens)
        n_pre = args.prefill_tokens // BLOCK
        pre_reps = max(5, args.reps // 2)
        pre_hashes = [block_hashes(5000 + i, n_pre) for i in range(pre_reps + 2)]
        step[0] = 0

        def publish_prefill():
            step[0] += 1
            publish_rows(store, KS, SPEC, BLOCK, 0, pre_rows, pre_hashes[step[0]])

        t_pre, m_pre = timeit_stats(publish_prefill, pre_reps)
        b_pre = memcpy_baseline(pre_rows.nbytes, args.reps)
        # Amortised: many prefill chunks back to back, so that the cost of
        # starting arenas (allocating and mapping their pages) is included.
        n_am = args.amortise_chunks
        am_hashes = [block_hashes(70000 + i, n_pre) for i in range(n_am)]
        started = store.stats().extra.get("arenas_started", 0)
        t0 = time.perf_counter()
        for h in am_hashes:
            publish_rows(store, KS, SPEC, BLOCK, 0, pre_rows, h)
        t_am = (time.perf_counter() - t0) / n_am
        started = store.stats().extra.get("arenas_started", 0) - started
        result["publish"] = {
            "decode_step": {
                "objects": n_dec,
                "bytes": int(dec_rows.nbytes),
                "seconds": t_dec,
                "mean_seconds": m_dec,
                "memcpy_seconds": b_dec,
                "ratio": t_dec / b_dec,
            },
            "prefill_8k": {
                "objects": n_pre,
                "bytes": int(pre_rows.nbytes),
                "seconds": t_pre,
                "mean_seconds": m_pre,
                "memcpy_seconds": b_pre,
                "ratio": t_pre / b_pre,
                "amortised_seconds": t_am,
                "amortised_ratio": t_am / b_pre,
                "amortised_over": {"chunks": n_am, "arenas_started": started},
            },
        }
        # --- the 32k request, two layouts -------------------------------------
        n_blocks = args.tokens // BLOCK
        rows1 = rows_for(1, args.tokens)
        h1 = block_hashes(1, n_blocks)
        chunk = args.prefill_tokens
        for lo in range(0, args.tokens, chunk):
            publish_rows(
                store,
                KS,
                SPEC,
                BLOCK,
                lo,
                rows1[lo : lo + chunk],
                h1[lo // BLOCK : (lo + chunk) // BLOCK],
                first_block_hash_index=lo // BLOCK,
            )
        rows2 = rows_for(2, args.tokens)
        h2 = block_hashes(2, n_blocks)
        other = rows_for(9, BLOCK * (n_dec - 1))
        for b in range(n_blocks):
            # One decode step: our block plus other requests' blocks.
            publish_rows(
                store,
                KS,
                SPEC,
                BLOCK,
                b * BLOCK,
                rows2[b * BLOCK : (b + 1) * BLOCK],
                h2[b : b + 1],
                first_block_hash_index=b,
            )
            if n_dec > 1:
                publish_rows(
                    store, KS, SPEC, BLOCK, 0, other, block_hashes(90000 + b, n_dec - 1)
                )
        proc = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--role",
                "reader",
                "--root",
                root,
                "--namespace",
                store.namespace,
                "--tokens",
                str(args.tokens),
                "--reps",
                str(args.reps),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        rd = json.loads(proc.stdout.strip().splitlines()[-1])
        base = rd.pop("memcpy_seconds")
        mat = {"objects": n_blocks, "bytes": int(rows1.nbytes), "memcpy_seconds": base}
        for layout, v in rd.items():
            mat[layout] = {
                "seconds": v["seconds"],
                "ratio": v["seconds"] / base,
                "checksum_seconds": v["checksum_seconds"],
                "checksum_share": v["checksum_seconds"] / v["seconds"],
            }
        result["materialize_32k_other_process"] = mat
        result["targets"] = {
            "materialize_within_3x": all(
                mat[k]["ratio"] <= 3.0  # type: ignore[index]
                for k in ("prefill_chunks", "decode_interleaved")
            ),
            "publish_within_5x": all(
                v["ratio"] <= 5.0
                for v in result["publish"].values()  # type: ignore[attr-defined]
            ),
        }
        result["store_stats"] = {
            "objects": store.stats().objects,
            "used_bytes": store.stats().used_bytes,
        }
        result["load_average_at_end"] = os.getloadavg()
        print(json.dumps(result, indent=2))
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
