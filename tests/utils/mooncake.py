# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A real ``mooncake_master`` for the tests of routes by reference through a
Mooncake Store (TCP on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

MASTER = Path(sys.executable).parent / "mooncake_master"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    """A ``mooncake_master`` process on 127.0.0.1 (stop and start again on
    the same port)."""

    def __init__(self, log: Path) -> None:
        self.port = _free_port()
        self.metrics_port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(MASTER), f"--rpc_port={self.port}",
                 f"--metrics_port={self.metrics_port}"],
                stdout=log, stderr=log,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            assert self.proc.poll() is None, "mooncake_master exited"
            assert time.monotonic() < deadline, "mooncake_master did not listen"
            time.sleep(0.05)

    def freeze(self, resume_after_s: float) -> None:
        """``SIGSTOP`` the master; another process sends ``SIGCONT`` after
        ``resume_after_s`` (so a call that waits for the master ends even
        when the code under test does not bound it), or :meth:`thaw`."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self._resumer = subprocess.Popen(
            ["sh", "-c", f"sleep {resume_after_s}; kill -CONT {self.proc.pid}"]
        )

    def still_frozen(self) -> bool:
        """The master has not been resumed since :meth:`freeze`."""
        resumer = getattr(self, "_resumer", None)
        return resumer is not None and resumer.poll() is None

    def thaw(self) -> None:
        resumer = getattr(self, "_resumer", None)
        if resumer is not None:
            if resumer.poll() is None:
                resumer.kill()
            resumer.wait()
            self._resumer = None
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.thaw()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.proc = None


@contextlib.contextmanager
def running_master(name: str):
    """A started :class:`Master` logging to ``.cache/logs/<name>.log``, with
    ``MC_FORCE_TCP`` set for the clients (loopback TCP, no RDMA device)."""
    os.environ["MC_FORCE_TCP"] = "true"
    log = Path(__file__).resolve().parents[2] / ".cache" / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    m = Master(log)
    m.start()
    try:
        yield m
    finally:
        m.stop()
        os.environ.pop("MC_FORCE_TCP", None)


class Ticker:
    """A thread that stands in for the rest of a process (a step loop, a
    trainer's data loaders): it ticks every millisecond while it can run.
    A Mooncake call that holds the interpreter lock leaves a hole in its
    ticks."""

    def __init__(self) -> None:
        self.ticks: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.ticks.append(time.monotonic())

    def ticked_between(self, start: float, end: float) -> bool:
        return any(start <= t <= end for t in self.ticks)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
