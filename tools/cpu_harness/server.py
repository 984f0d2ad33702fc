# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Start and stop a real ``vllm serve`` for the demo and the HTTP tests.

The server runs in its own session (process group), so stopping it reaches the
API server, EngineCore and every worker, and nothing is left behind: its
``TMPDIR`` is a private folder under ``.cache/tmp`` removed when it stops.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from harness_env import CACHE, harness_env, run_tmpdir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """``with VllmServer(model, [flags]) as srv: srv.base_url``."""

    def __init__(
        self,
        model: str | os.PathLike,
        extra_args: list[str],
        startup_timeout: float = 300.0,
        log_name: str = "vllm-serve.log",
    ):
        self.model = str(model)
        self.port = free_port()
        self.extra_args = extra_args
        self.startup_timeout = startup_timeout
        self.log_path = Path(CACHE) / "logs" / log_name
        self.proc: subprocess.Popen | None = None
        self.tmpdir: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> VllmServer:
        self.tmpdir = run_tmpdir("server")
        env = dict(os.environ, **harness_env())
        env["TMPDIR"] = str(self.tmpdir)
        vllm = Path(sys.executable).with_name("vllm")
        cmd = [str(vllm), "serve", self.model, "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), *self.extra_args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            self._wait_healthy(self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {proc.returncode}; "
                    f"log: {self.log_path}\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        raise TimeoutError(f"vllm serve not healthy after {self.startup_timeout}s")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        try:
            self._stop_group()
        finally:
            if self.tmpdir is not None:
                shutil.rmtree(self.tmpdir, ignore_errors=True)
                self.tmpdir = None

    def _stop_group(self) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # its own session: pgid == pid
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; make sure no child of the group survives.
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(pgid):
                time.sleep(0.2)
            if not _group_alive(pgid):
                break
        self.proc = None
        self._log.close()

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
