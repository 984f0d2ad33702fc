# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Process identity (pid + start time, pidfd) shared by the same-node stores."""

from __future__ import annotations

import os
import subprocess
import sys

from vllm_host_transport.process_identity import (
    ProcessWatch,
    judge_origin,
    pid_namespace,
    process_start_ticks,
)


def test_self_is_alive_and_start_ticks_are_stable():
    ticks = process_start_ticks(os.getpid())
    assert ticks is not None and ticks > 0
    assert process_start_ticks(os.getpid()) == ticks
    with ProcessWatch(os.getpid(), ticks) as watch:
        assert watch.alive()


def test_exited_process_is_dead_and_stays_dead():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    ticks = process_start_ticks(child.pid)
    assert ticks is not None
    watch = ProcessWatch(child.pid, ticks)
    try:
        assert watch.alive()
        child.communicate(b"")  # child exits and is reaped
        assert not watch.alive()
        assert not watch.alive()
    finally:
        watch.close()
    assert process_start_ticks(child.pid) is None


def test_reused_pid_with_another_start_time_is_not_the_same_process():
    ticks = process_start_ticks(os.getpid())
    assert ticks is not None
    # Same pid, different start time: what a restarted process looks like.
    with ProcessWatch(os.getpid(), ticks + 1) as watch:
        assert not watch.alive()


def test_missing_pid_is_dead():
    # pid_max is at most 2**22 on Linux: this pid cannot exist.
    with ProcessWatch(2**22 + 1, 1) as watch:
        assert not watch.alive()


def test_an_origin_is_judged_only_in_its_own_namespace_and_boot():
    own = pid_namespace()
    assert own != 0
    assert judge_origin(True, own) is True
    assert judge_origin(True, own + 1) is None  # another container: cannot tell
    assert judge_origin(True, 0) is None  # unknown namespace: cannot tell
    assert judge_origin(False, own) is False  # another boot: gone
