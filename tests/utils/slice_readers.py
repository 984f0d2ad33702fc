# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trainer ranks reading their slices of the same references at once.

``python slice_readers.py JOB.json`` (run on the engine's node, or on
another simulated node for Mooncake references) starts ``stages x halves``
processes that import ``vllm_host_transport`` only. The job names the
references, the model's config (for each pipeline stage's MoE layers), the
number of pipeline stages and data-parallel halves, and an output
directory. Rank ``(stage, half)`` reads the references of its half
(``refs[half::halves]``), the MoE layers of its stage, all rows, packed and
layer-major as int64 (what a replay takes), all ranks released together by
a barrier; it saves its array, ``cu_seqlens`` and its layers to
``OUT/rank-<stage>-<half>.npz`` and, with ``"release": true``, marks itself
done (``reader=stage, readers=stages``: the last stage of a half removes
its references). Prints one JSON line: each rank's error (if any), bytes
read and seconds.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time

# Run as a script, its own directory comes first on sys.path, and
# tests/utils/mooncake.py would shadow Mooncake's package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def _rank(job: dict, stage: int, half: int, barrier, queue) -> None:  # type: ignore[no-untyped-def]
    import numpy as np

    from vllm_host_transport.routes_layers import moe_layers_of_stage
    from vllm_host_transport.routes_reader import read_batch, release, stats

    answer: dict = {"stage": stage, "half": half}
    try:
        refs = job["refs"][half :: job["halves"]]
        layers = moe_layers_of_stage(job["config"], stage, job["stages"])
        barrier.wait(timeout=60)
        start = time.perf_counter()
        routes, cu = read_batch(
            refs, layers=layers, dtype="int64", packed=True, layer_major=True
        )
        answer["seconds"] = time.perf_counter() - start
        np.savez(
            f"{job['out']}/rank-{stage}-{half}.npz",
            routes=routes,
            cu_seqlens=cu,
            layers=np.array(layers, np.int64),
        )
        answer.update(stats())
        if job.get("release"):
            barrier.wait(timeout=60)  # every rank read before any releases
            answer["removed"] = release(refs, reader=stage, readers=job["stages"])
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "torch"))
        answer["loaded"] = loaded
    except BaseException as e:  # reported, the parent decides
        answer["error"] = f"{type(e).__name__}: {e}"
        barrier.abort()
    queue.put(answer)


def check(answers: list, refs: list, want: list, out: str, halves: int) -> None:
    """The parent's checks of :func:`main`'s answers: no rank failed or
    imported vLLM or torch; each rank's array equals ``want`` (the oracle's
    ``[rows, layers, top_k]`` per reference) at its references and layers,
    int64, packed layer-major; it read exactly its layers' rows plus the
    headers (``bytes_avoided`` the rest); with ``release``, each reference
    was removed once."""
    import numpy as np

    for a in answers:
        assert "error" not in a, a
        assert a["loaded"] == [], f"a trainer rank imported {a['loaded']}"
        got = np.load(f"{out}/rank-{a['stage']}-{a['half']}.npz")
        layers = [int(x) for x in got["layers"]]
        mine = list(range(a["half"], len(refs), halves))
        cu = got["cu_seqlens"]
        read = body = 0
        for b, i in enumerate(mine):
            rows = got["routes"][:, cu[b] : cu[b + 1]]  # [layers, T, K]
            assert rows.dtype == np.int64
            np.testing.assert_array_equal(rows, want[i][:, layers].transpose(1, 0, 2))
            ref = refs[i]
            mine_body = len(layers) * ref["nbytes"] // ref["shape"][1]
            read += ref["header_nbytes"] + mine_body
            body += ref["nbytes"] - mine_body
        # Exactly its layers' rows and the headers: nothing more was read.
        assert a["bytes_read"] == read, (a, read)
        assert a["bytes_avoided"] == body, (a, body)
    if any("removed" in a for a in answers):
        assert sum(a["removed"] for a in answers) == len(refs)


def main(path: str) -> None:
    with open(path) as f:
        job = json.load(f)
    ctx = mp.get_context("spawn")
    ranks = [(s, h) for h in range(job["halves"]) for s in range(job["stages"])]
    barrier = ctx.Barrier(len(ranks))
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(job, s, h, barrier, queue)) for s, h in ranks
    ]
    for p in procs:
        p.start()
    answers = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    print(json.dumps(sorted(answers, key=lambda a: (a["half"], a["stage"]))))


if __name__ == "__main__":
    main(sys.argv[1])
