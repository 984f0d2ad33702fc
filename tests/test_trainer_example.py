# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The trainer integration guide's example runs as the guide says
(docs/examples/trainer_slices.py): a real offline ``LLM`` hands out
references, 8 spawned trainer ranks (4 pipeline stages x 2 data-parallel
halves) each read their stage's MoE layers for their half, build and check
megatron-core's ``RouterReplay`` input, and the last of them removes every
payload; a read afterwards fails with ``RouteRefMissingError``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent


def test_the_eight_rank_example_runs():
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "examples" / "trainer_slices.py"),
         "--requests", "4"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    ranks = re.findall(
        r"^rank (\d): stage (\d) half (\d) layers \[([\d, ]*)\]", out, re.M
    )
    assert sorted(int(r[0]) for r in ranks) == list(range(8)), out
    # Layer 0 of the example's model is dense: stage 0 replays none of it.
    assert all("0" not in r[3].split(", ") for r in ranks), out
    assert "after the last reader: RouteRefMissingError" in out, out
