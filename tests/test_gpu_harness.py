# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GPU harness's plumbing, on the CPU (no device, no engine): every GPU
test that has nothing to check skips with its reason instead of passing,
and ``tests/gpu/make_carry.sh`` finds the shared harness's tools from a
clone anywhere, or says what to set (r5, issue 37 item 11)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "tests" / "gpu"
SHARED_TOOLS = ("run.sh", "probe.py", "fetch_wheels.sh")


@pytest.fixture(scope="module")
def gpu_tests():
    """tests/gpu/test_r3_gpu.py as a module (it puts tests/gpu and tests/ on
    sys.path for its engine helper; restored afterwards)."""
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location(
        "r3_gpu_tests_under_test", GPU / "test_r3_gpu.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = saved


def _tests(module) -> dict[str, Callable]:
    return {
        name: fn
        for name, fn in vars(module).items()
        if name.startswith("test_") and callable(fn)
    }


def _outcome(fn: Callable, runs: dict) -> str:
    """``skip: <reason>``, or ``passed`` when it returned having checked
    nothing (a failure propagates)."""
    try:
        fn(runs)
    except pytest.skip.Exception as e:
        return f"skip: {e.msg}"
    return "passed"


def test_with_no_case_run_every_gpu_test_skips_with_a_reason(gpu_tests):
    """With an empty case set (``R3_GPU_CASES`` naming none of a test's
    cases) no test may pass: each skips, saying why."""
    outcomes = {name: _outcome(fn, {}) for name, fn in _tests(gpu_tests).items()}
    assert len(outcomes) >= 25, sorted(outcomes)
    passed = sorted(name for name, o in outcomes.items() if o == "passed")
    assert passed == [], outcomes
    assert all(o.strip() != "skip:" for o in outcomes.values()), outcomes


@pytest.mark.parametrize(
    "name",
    [
        "test_spec_decode_same_routes_as_ref",
        "test_spec_decode_matches_transformers_router",
        "test_spec_decode_drafts_accepted_and_rejected",
    ],
)
def test_speculative_tests_skip_without_a_speculative_case(gpu_tests, name):
    """The case set of a 0.34.0 run without speculative cases: the
    non-speculative references ran (never looked at here), no ``spec*``."""
    runs = {"ref": object(), "ref_ieee": object()}
    outcome = _outcome(getattr(gpu_tests, name), runs)
    assert outcome.startswith("skip: ") and "speculative" in outcome, outcome


def test_script_mode_runs_every_gpu_test(gpu_tests):
    """``python3 tests/gpu/test_r3_gpu.py`` (no pytest on the device) runs
    the tests defined before its ``__main__`` block: none may follow it."""
    text = (GPU / "test_r3_gpu.py").read_text()
    after_main = text.partition('\nif __name__ == "__main__":')[2]
    assert "\ndef test_" not in after_main


# ------------------------------------------------------------ make_carry.sh


def _clone(at: Path) -> Path:
    """A clone of the checkout that holds only make_carry.sh (enough for the
    tools' lookup, which comes first)."""
    (at / "tests" / "gpu").mkdir(parents=True)
    shutil.copy(GPU / "make_carry.sh", at / "tests" / "gpu" / "make_carry.sh")
    return at


def _shared(at: Path) -> Path:
    tools = at / "tools" / "gpu"
    tools.mkdir(parents=True)
    for name in SHARED_TOOLS:
        (tools / name).write_text("")
    return tools


def _where(clone: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "SHARED_DIR"}
    return subprocess.run(
        ["bash", str(clone / "tests" / "gpu" / "make_carry.sh"), "--shared-tools"],
        capture_output=True,
        text=True,
        env={**environ, **env},
        timeout=60,
    )


@pytest.fixture
def outside():
    """A directory with no shared/tools/gpu in it or above it: under /tmp
    (the checkout's own .cache/ sits below the real shared/), named with
    this session's pid and removed afterwards."""
    if any(Path(p, "shared", "tools", "gpu").exists() for p in ("/tmp", "/")):
        pytest.skip("a shared/tools/gpu exists at / or /tmp on this machine")
    path = Path(f"/tmp/vart-test-{os.getpid()}-carry")
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_make_carry_finds_the_shared_tools_above_a_clone_anywhere(outside):
    """A clone that does not sit beside shared/ (here two levels below the
    directory that holds it) finds the tools by looking upward."""
    tools = _shared(outside / "shared")
    proc = _where(_clone(outside / "work" / "clone"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tools)


def test_make_carry_takes_shared_dir_from_the_environment(outside):
    tools = _shared(outside / "elsewhere" / "shared")
    proc = _where(_clone(outside / "clone"), SHARED_DIR=str(tools.parent.parent))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tools)


def test_make_carry_without_the_shared_tools_says_what_to_set(outside):
    """No shared tools anywhere: a clear error naming SHARED_DIR (rc 2), not
    a command missing halfway through (rc 127)."""
    clone = _clone(outside / "clone")
    proc = _where(clone)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "set SHARED_DIR=/path/to/shared" in proc.stderr, proc.stderr
    proc = _where(clone, SHARED_DIR=str(outside / "missing"))
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "SHARED_DIR=" in proc.stderr and "tools/gpu" in proc.stderr
