# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Many engines per node: four engines, each its own process, share one
small ``/dev/shm`` (a tmpfs mounted over it in a private mount namespace).
Their stores' capacities together exceed it several times (the situation of
eight engines with the old fixed 8 GiB defaults on a smaller ``/dev/shm``),
so it fills and their puts meet ``ENOSPC``; each store then evicts its own
oldest routes and retries. Every request of every engine must still return
routes equal to transformers' router, and the stores must really have met
the full file system (``space_evictions``).

Without the evict-and-retry path, the first put that met the full tmpfs
failed its request with ``StoreCapacityError`` (run on this harness before
the fix: see the commit that added this test)."""

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
ROUNDS = 6
PER_ROUND = 6
# A 4 MiB /dev/shm: each engine's store is sized from it (engines_per_node 4:
# 4 MiB / 2 / 4 * 2/3 = 341 KiB, 64 KiB arenas). Other files take all but
# ROOM of it, less than the four capacities together (1.33 MiB) but enough
# that three full stores leave the fourth its few arenas.
SHM_SIZE = "4m"
ROOM = 1200 << 10
CAPACITY = 0  # derived


def _run_engines(tiny_moe, out: str) -> None:
    """The four engines at once, in one namespace with the small tmpfs as
    its /dev/shm; each writes its results (and its log) into ``out``."""
    driver = os.path.join(os.path.dirname(__file__), "utils", "shm_engine.py")
    other = (4 << 20) - ROOM
    lines = [f"head -c {other} /dev/zero > /dev/shm/other-files || exit 1", 'pids=""']
    for i in range(ENGINES):
        argv = [sys.executable, driver, str(tiny_moe), out, str(i)]
        argv += [str(ENGINES), str(ROUNDS), str(PER_ROUND), str(CAPACITY)]
        lines.append(f"{shlex.join(argv)} > {out}/log-{i} 2>&1 &")
        lines.append('pids="$pids $!"')
    lines.append("rc=0; for p in $pids; do wait $p || rc=1; done; exit $rc")
    script = os.path.join(out, "run.sh")
    with open(script, "w") as f:
        f.write("\n".join(lines) + "\n")
    r = subprocess.run(small_shm_argv(SHM_SIZE, f"sh {script}"), timeout=900)
    if r.returncode:
        logs = []
        for i in range(ENGINES):
            with contextlib.suppress(OSError), open(f"{out}/log-{i}") as f:
                logs.append(f"--- engine {i}\n{f.read()[-3000:]}")
        raise AssertionError(
            f"an engine failed (rc {r.returncode}):\n" + "\n".join(logs)
        )


def test_four_engines_share_a_small_dev_shm_and_stay_exact(tiny_moe, tmp_path):
    skip_unless_private_shm()
    out = str(tmp_path)
    _run_engines(tiny_moe, out)
    evictions, failures, checked = [], [], 0
    for i in range(ENGINES):
        with open(os.path.join(out, f"engine-{i}.json")) as f:
            report = json.load(f)
        stats = report["stats"]
        evictions.append(stats["space_evictions"])
        data = np.load(os.path.join(out, f"engine-{i}.npz"))
        for r in range(ROUNDS):
            for k in range(PER_ROUND):
                name = f"r{r}p{k}"
                if f"{name}_error" in data:
                    failures.append((i, name, str(data[f"{name}_error"])))
                    continue
                completion = SimpleNamespace(
                    routed_experts=data[f"{name}_routes"],
                    routed_experts_error=None,
                    token_ids=data[f"{name}_tokens"].tolist(),
                    finish_reason="length",
                )
                prompt = data[f"{name}_prompt"].tolist()
                assert_exact(tiny_moe, prompt, completion, dtype=np.int32)
                checked += 1
        shm = report["shm_after_rounds"]
        print(f"engine {i}: {stats}; /dev/shm after each round {shm}")
    assert not failures, failures
    assert checked == ENGINES * ROUNDS * PER_ROUND
    # The tmpfs was really full: the stores had to evict to make room.
    assert sum(evictions) > 0, evictions
