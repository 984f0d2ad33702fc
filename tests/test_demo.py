# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`make demo` end to end: real server, openai client, summary, picture, cleanup."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.engine


def _our_processes() -> set[int]:
    """PIDs of vLLM server, EngineCore and worker processes run from this
    checkout (their titles are ``vllm serve ...`` or ``VLLM::...``)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True)
    pids = set()
    for line in out.stdout.splitlines():
        pid, _, args = line.strip().partition(" ")
        if "vllm serve" not in args and not args.startswith("VLLM::"):
            continue
        try:
            cwd = Path(f"/proc/{pid}/cwd").resolve()
        except OSError:
            continue  # exited meanwhile
        if cwd.is_relative_to(ROOT):
            pids.add(int(pid))
    return pids


def test_demo_prints_routes_writes_picture_and_stops_everything():
    picture = ROOT / ".cache" / "demo" / "routing.png"
    picture.unlink(missing_ok=True)
    before = _our_processes()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "demo.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for title in ("== completion", "== chat completion"):
        assert title in out
    assert out.count("(tokens x layers x top_k), dtype uint8") == 2
    assert out.count("layer 1: [") == 2  # per-layer expert counts of both
    assert picture.is_file() and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _our_processes() <= before, "the demo left server processes behind"
