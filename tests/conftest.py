# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared test set-up: the CPU harness environment and leak guards.

Every cache and temporary file goes under the repository's ``.cache/``; the
session fails if the tests leave anything new in ``/dev/shm`` or ``/tmp``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
for sub in ("tools", "tools/cpu_harness"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from harness_env import CACHE, apply_harness_env  # noqa: E402

apply_harness_env(override=True)
tempfile.tempdir = None  # re-read TMPDIR (now inside .cache/)


def _entries(path: str) -> set[str]:
    try:
        return set(os.listdir(path))
    except OSError:
        return set()


@pytest.fixture(scope="session", autouse=True)
def no_leftovers():
    """Fail the session if tests leave files in /dev/shm or /tmp."""
    before = {p: _entries(p) for p in ("/dev/shm", "/tmp")}
    yield
    leaked = {}
    for path, old in before.items():
        new = sorted(_entries(path) - old)
        # Other sessions on a shared node may create their own entries: only
        # names our code uses count as ours.
        ours = [n for n in new if n.startswith(("vllm", "pytest", "torch", "tmp"))]
        if ours:
            leaked[path] = ours
    if leaked:
        pytest.fail(f"tests left files behind: {leaked}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_moe() -> Path:
    """The default tiny MoE (float32, 2 layers, 8 experts, top-2)."""
    from build_tiny_moe import build

    return build(CACHE / "models" / "tiny-moe")
