# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The environment of the CPU test/demo harness, in one place.

Used by ``tests/conftest.py``, ``tools/demo.py`` and the benchmarks. Every cache,
socket and temporary file goes under the repository's ignored ``.cache/`` so
nothing leaks into ``/tmp`` or the home directory.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache"


def harness_env(enable_triton_interpreter: bool = True) -> dict[str, str]:
    """Variables to set for a real engine on this CPU harness."""
    tmp = CACHE / "tmp"
    for sub in ("tmp", "vllm", "triton", "hf", "rpc", "xdg", "torchinductor"):
        (CACHE / sub).mkdir(parents=True, exist_ok=True)
    env = {
        # Model Runner V2 is the runner that captures routed experts.
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
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
        "TMPDIR": str(tmp),
        "TOKENIZERS_PARALLELISM": "false",
    }
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
