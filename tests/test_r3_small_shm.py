# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Many engines per node: four engines, each its own process, share one
small ``/dev/shm`` (a 4 MiB tmpfs mounted over it in a private mount
namespace), their stores sized from it (``engines_per_node`` 4: 341 KiB
each, 64 KiB arenas).

Each engine first publishes a few prompts, so that its store holds its
active arena and the spare its upkeep prepares; then, with the four engines
waiting, another tenant takes all of ``/dev/shm`` but half an arena. Every
engine then publishes more than two arenas' worth: each new arena it needs
finds less than an arena free although its store is far below its capacity,
so it must give back its own oldest arena first (``space_evictions``). The
engines stop at the same point whatever the order they ran in, so the run is
the same every time: no store can take what the others freed (a store
leaves one arena free when it grows, ``space.keep_headroom``, and the tenant
leaves less), and each store's own old arena is always there to evict (two
requests at a time hold less than an arena).

Every request of every engine must return routes equal to transformers'
router, and every store must have evicted for room. Without the
evict-for-room path (``space.when_full`` and ``space.keep_headroom``) the
first arena an engine needs after the tenant's fill fails with ``ENOSPC``
and its requests carry ``StoreCapacityError`` (run on this harness: see the
commit that rebuilt this test)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from utils.r3 import assert_exact
from utils.shm_ns import skip_unless_private_shm, small_shm_argv

pytestmark = pytest.mark.engine

ENGINES = 4
SHM_SIZE = "4m"
ARENA = 64 << 10  # the arenas of a 341 KiB store (the smallest there are)
# What the other tenant leaves free: below one arena.
ROOM = ARENA // 2
# Routes of the tiny model: 2 layers x top-2 uint8, 4 bytes a token, 192
# bytes for a 32-token block with its envelope: a 1000-token prompt publishes
# about 6 KB, so an arena holds about ten of them. Two requests at a time
# hold at most a fifth of an arena: an old arena's retained objects always
# fit in the active one.
PLAN = {
    "prompt_len": 1000,
    "max_num_seqs": 2,
    "warm": 6,  # the active arena about half full, the spare prepared
    "rounds": 6,
    "per_round": 6,  # 36 prompts, about 3.3 arenas after the fill
}
PROMPTS = PLAN["warm"] + PLAN["rounds"] * PLAN["per_round"]


def _run_engines(tiny_moe, out: str) -> None:
    """The four engines and the other tenant at once, in one namespace with
    the small tmpfs as its /dev/shm; each engine writes its results (and
    its log) into ``out``."""
    driver = os.path.join(os.path.dirname(__file__), "utils", "shm_engine.py")
    lines = ['pids=""']
    for i in range(ENGINES):
        argv = [sys.executable, driver, "engine", str(tiny_moe), out, str(i)]
        argv += [str(ENGINES), json.dumps(PLAN)]
        lines.append(f"{shlex.join(argv)} > {out}/log-{i} 2>&1 &")
        lines.append('pids="$pids $!"')
    fill = [sys.executable, driver, "fill", out, str(ENGINES), str(ROOM)]
    lines.append(f"{shlex.join(fill)} > {out}/log-fill 2>&1 &")
    lines.append('pids="$pids $!"')
    lines.append("rc=0; for p in $pids; do wait $p || rc=1; done; exit $rc")
    script = os.path.join(out, "run.sh")
    with open(script, "w") as f:
        f.write("\n".join(lines) + "\n")
    r = subprocess.run(small_shm_argv(SHM_SIZE, f"sh {script}"), timeout=900)
    if r.returncode:
        logs = []
        for name in [f"log-{i}" for i in range(ENGINES)] + ["log-fill"]:
            with contextlib.suppress(OSError), open(f"{out}/{name}") as f:
                logs.append(f"--- {name}\n{f.read()[-3000:]}")
        raise AssertionError(
            f"an engine failed (rc {r.returncode}):\n" + "\n".join(logs)
        )


def test_four_engines_share_a_small_dev_shm_and_stay_exact(tiny_moe, tmp_path):
    skip_unless_private_shm()
    out = str(tmp_path)
    _run_engines(tiny_moe, out)
    with open(os.path.join(out, "fill.json")) as f:
        fill = json.load(f)
    print(f"other tenant took {fill['taken']} bytes, left {fill['after']['free']}")
    # The tenant left less than an arena free.
    assert fill["after"]["free"] < ARENA, fill
    evictions, failures, checked = [], [], 0
    for i in range(ENGINES):
        with open(os.path.join(out, f"engine-{i}.json")) as f:
            report = json.load(f)
        stats = report["stats"]
        # Sized from the 4 MiB tmpfs: 4 MiB / 2 / 4 engines * 2/3.
        assert stats["capacity_bytes"] == (4 << 20) // 2 // ENGINES * 2 // 3, stats
        assert report["arenas_at_barrier"] >= 2, report
        evictions.append(stats["space_evictions"])
        data = np.load(os.path.join(out, f"engine-{i}.npz"))
        names = [f"warmp{k}" for k in range(PLAN["warm"])] + [
            f"r{r}p{k}" for r in range(PLAN["rounds"]) for k in range(PLAN["per_round"])
        ]
        for name in names:
            if f"{name}_error" in data:
                failures.append((i, name, str(data[f"{name}_error"])))
                continue
            completion = SimpleNamespace(
                routed_experts=data[f"{name}_routes"],
                routed_experts_error=None,
                token_ids=data[f"{name}_tokens"].tolist(),
                finish_reason="length",
            )
            assert_exact(tiny_moe, data[f"{name}_prompt"].tolist(), completion)
            checked += 1
        print(
            f"engine {i}: arenas at the barrier {report['arenas_at_barrier']}, "
            f"{stats}; /dev/shm free after each round "
            f"{[r['free'] for r in report['shm_after_rounds']]}"
        )
    assert not failures, failures
    assert checked == ENGINES * PROMPTS
    # Every store met the full tmpfs and gave back its own oldest arena.
    assert all(e > 0 for e in evictions), evictions
