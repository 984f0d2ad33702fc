# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared test set-up: the CPU harness environment and leak guards.

Every cache and temporary file goes under the repository's ``.cache/``; the
session fails if the tests leave anything new in ``/dev/shm`` or ``/tmp``
that this test session created (other sessions on a shared node create their
own entries there; those do not count).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
for sub in ("tools", "tools/cpu_harness"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from harness_env import CACHE, DIST_FILE_PREFIX, apply_harness_env  # noqa: E402

apply_harness_env(override=True)
tempfile.tempdir = None  # re-read TMPDIR (now inside .cache/)


# tests/gpu runs on the lent GPU through tests/gpu/device_run.sh (with
# --confcutdir=tests/gpu, so this file is not loaded there), never on the CPU.
collect_ignore = ["gpu"]

GUARDED = ("/dev/shm", "/tmp")


def _entries(path: str) -> set[str]:
    try:
        return set(os.listdir(path))
    except OSError:
        return set()


class SessionFiles:
    """Which entries of /dev/shm and /tmp this session's processes used.

    A file left behind is attributed to this session when (a) one of its
    processes (pytest and every descendant: servers, EngineCore, workers) had
    it open or mapped, sampled from /proc every ``interval`` seconds, or (b)
    its name, or the name of a file directly in it, carries the pid of one of
    those processes (``torch_<pid>_...``, ``vart-test-<pid>-...``). Entries of
    other sessions match neither. A file created and closed between two
    samples, without a pid in its name, goes unnoticed: the guard cannot tell
    whose it is.
    """

    def __init__(self, interval: float = 0.5):
        self.pids: set[int] = {os.getpid()}
        # root -> entry -> who used it first (process and running test), for
        # the failure message
        self.touched: dict[str, dict[str, str]] = {root: {} for root in GUARDED}
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="leak-guard", daemon=True
        )

    def __enter__(self) -> SessionFiles:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def sample(self) -> None:
        tree = _descendants(os.getpid())
        self.pids |= tree
        test = os.environ.get("PYTEST_CURRENT_TEST", "no test").split(" ")[0]
        for pid in tree:
            for path in _paths_used_by(pid):
                for root in GUARDED:
                    if path.startswith(root + "/"):
                        top = path[len(root) + 1 :].split("/", 1)[0]
                        top = top.removesuffix(" (deleted)")
                        if top not in self.touched[root]:
                            who = f"pid {pid} ({_comm(pid)}) during {test}"
                            self.touched[root][top] = who

    def ours(self, root: str, names: set[str]) -> list[str]:
        found = []
        for name in sorted(names):
            # a folder's own files may carry the pid (``<root>/<dir>/x-<pid>``)
            tagged = [name, *_entries(os.path.join(root, name))]
            numbers = {int(n) for s in tagged for n in re.findall(r"\d+", s)}
            if name in self.touched[root] or numbers & self.pids:
                found.append(name)
        return found

    def in_use(self, root: str, name: str) -> bool:
        """Whether a live process of this session holds the entry now."""
        path = os.path.join(root, name)
        for pid in _descendants(os.getpid()):
            if any(p.removesuffix(" (deleted)") == path for p in _paths_used_by(pid)):
                return True
        return False

    def who(self, root: str, name: str) -> str:
        """Which process used the entry first, and during which test."""
        return self.touched[root].get(name, "named with a pid of this session")


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return "gone"


def _descendants(root: int) -> set[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = {root}, [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _paths_used_by(pid: int) -> set[str]:
    paths = set()
    try:
        with open(f"/proc/{pid}/maps") as fh:
            for line in fh:
                if "/dev/shm/" in line or "/tmp/" in line:
                    paths.add(line.split(None, 5)[-1].strip())
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                paths.add(os.readlink(f"{fd_dir}/{fd}"))
            except OSError:
                continue
    except OSError:
        pass
    return paths


@pytest.fixture(scope="session", autouse=True)
def no_leftovers():
    """Fail the session if its processes leave files in /dev/shm or /tmp, and
    remove the rendezvous files its in-process engines left in .cache/tmp."""
    before = {p: _entries(p) for p in GUARDED}
    dist_before = {p.name for p in (CACHE / "tmp").glob(DIST_FILE_PREFIX + "*")}
    with SessionFiles() as session:
        yield
    for path in (CACHE / "tmp").glob(DIST_FILE_PREFIX + "*"):
        if path.name not in dist_before:
            path.unlink(missing_ok=True)

    def leftovers() -> dict[str, list[str]]:
        found = {}
        for root, old in before.items():
            ours = session.ours(root, _entries(root) - old)
            if ours:
                found[root] = ours
        return found

    # A killed process's shared memory (vLLM's message queues) is unlinked
    # by its multiprocessing resource tracker, which may still be at it on a
    # loaded machine: only what is still there after that counts.
    deadline = time.monotonic() + 20.0
    while (leaked := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.5)
    # vLLM's shared-memory message queues (``psm_*``) are unlinked only by
    # their ring buffer's ``__del__``; an EngineCore that exits without
    # running it leaves them to the session's multiprocessing resource
    # tracker, which removes them when pytest exits, after this guard. Do
    # that now for segments whose users have all exited, and say so.
    for root, names in leaked.items():
        for name in list(names):
            if name.startswith("psm_") and not session.in_use(root, name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(root, name))
                warnings.warn(
                    f"removed {root}/{name}, left by an exited process for the "
                    f"resource tracker ({session.who(root, name)})",
                    stacklevel=1,
                )
                names.remove(name)
    leaked = {root: names for root, names in leaked.items() if names}
    if leaked:
        described = {
            root: [f"{name} ({session.who(root, name)})" for name in names]
            for root, names in leaked.items()
        }
        pytest.fail(f"tests left files behind: {described}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_moe() -> Path:
    """The default tiny MoE (float32, 2 layers, 8 experts, top-2)."""
    from build_tiny_moe import build

    return build(CACHE / "models" / "tiny-moe")
