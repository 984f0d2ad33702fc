# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The environment of the CPU test/demo harness, in one place.

Used by ``tests/conftest.py``, ``tools/demo.py`` and the benchmarks. Every cache,
socket and temporary file goes under the repository's ignored ``.cache/`` so
nothing leaks into ``/tmp`` or the home directory.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache"
TMP = CACHE / "tmp"
# Private temporary folders of one run (a served engine, the serve wrapper):
# ``run-<tag>-<owner pid>-<hex>``, removed when the run ends, or by
# prune_tmp() once the owner is gone.
RUN_PREFIX = "run-"
# torch.distributed's FileStore rendezvous files, one per engine start; vLLM
# never removes them.
DIST_FILE_PREFIX = "vllm_dist_"
STALE_DIST_FILE_S = 24 * 3600


def harness_env(
    enable_triton_interpreter: bool = True, offline: bool = True
) -> dict[str, str]:
    """Variables to set for a real engine on this CPU harness.

    ``offline`` forbids hub access (tests and the demo use local models only).
    """
    tmp = TMP
    for sub in ("tmp", "vllm", "triton", "hf", "rpc", "xdg", "torchinductor", "mpl"):
        (CACHE / sub).mkdir(parents=True, exist_ok=True)
    env = {
        # Model Runner V2 is the runner that captures routed experts.
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(CACHE / "vllm"),
        "VLLM_CONFIG_ROOT": str(CACHE / "vllm"),
        "VLLM_RPC_BASE_PATH": str(CACHE / "rpc"),
        "TRITON_CACHE_DIR": str(CACHE / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(CACHE / "torchinductor"),
        "HF_HOME": str(CACHE / "hf"),
        "XDG_CACHE_HOME": str(CACHE / "xdg"),
        "XDG_CONFIG_HOME": str(CACHE / "xdg"),
        "MPLCONFIGDIR": str(CACHE / "mpl"),
        "TMPDIR": str(tmp),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
    if enable_triton_interpreter:
        env["VLLM_FORK_CPU_HARNESS"] = "1"
        env["TRITON_INTERPRET"] = "1"
    return env


def apply_harness_env(
    override: bool = False, enable_triton_interpreter: bool = True
) -> None:
    """Set the harness environment in this process (children inherit it).

    Call it before torch or vllm is imported (importing vllm creates torch's
    inductor cache directory under ``TMPDIR``). The ``.pth`` hook ran at
    start-up, before these variables existed, so the Triton stub is installed
    here for this process too.
    """
    for key, value in harness_env(enable_triton_interpreter).items():
        if override:
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)
    if enable_triton_interpreter:
        import vllm_fork_cpu_harness

        vllm_fork_cpu_harness.install()


def run_tmpdir(tag: str) -> Path:
    """A fresh private temporary folder for one run, owned by this process.

    Give it to a server as ``TMPDIR`` and remove it when the server stops: the
    engine's per-start files (``vllm_dist_*`` rendezvous files, sockets) then
    go with it instead of piling up in ``.cache/tmp``.
    """
    prune_tmp()
    path = TMP / f"{RUN_PREFIX}{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path


def prune_tmp(now: float | None = None) -> list[Path]:
    """Remove what runs left in ``.cache/tmp``; return what was removed.

    * ``run-*-<pid>-*`` folders whose owner process is gone (killed before
      it could clean up);
    * ``vllm_dist_*`` files older than a day (engines started in-process write
      them to ``TMPDIR`` itself; tests remove their own at the end).
    """
    removed: list[Path] = []
    now = time.time() if now is None else now
    try:
        entries = list(TMP.iterdir())
    except OSError:
        return removed
    for path in entries:
        name = path.name
        if name.startswith(RUN_PREFIX):
            parts = name.rsplit("-", 2)
            if len(parts) != 3 or not parts[1].isdigit():
                continue
            if _alive(int(parts[1])):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif name.startswith(DIST_FILE_PREFIX):
            try:
                if now - path.stat().st_mtime < STALE_DIST_FILE_S:
                    continue
                path.unlink()
            except OSError:
                continue
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
