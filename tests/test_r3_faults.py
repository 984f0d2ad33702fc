# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""R3 under store faults, against a real ``vllm serve --enable-routed-experts``.

Every fault is real, made from outside the engine the way an operator or the
node would make it, never by patching the engine:

1. ``/dev/shm`` full while routes are published: the store root lives on a
   small tmpfs mounted under ``/dev/shm`` and a filler file takes the rest of
   it (a real ``ENOSPC``).
2. An object corrupted, and an arena file deleted, after a running
   request's blocks were published and before it finished.
3. The store directory "made unreadable" while serving. The tests run as
   root, which ignores permission bits, so ``chmod 000`` changes nothing; what
   an operator really can do is remove the directory (``rm -rf``) or put a
   non-directory in its place.
4. A stale store of a dead process with the same namespace (writer level: a
   SIGKILLed writer process; engine level, see 5).
5. The whole engine SIGKILLed mid-request, then a new engine on the same root.

In every case an affected request gets a typed error or exact routes (never
wrong or partial rows), the server keeps serving (a following request is
exact), and nothing is left in ``/dev/shm``. Each test records what the client
saw and what was left in ``.cache/logs/r3-faults.jsonl`` (the fault table of
the issue note).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from utils.r3 import (
    SHARED_PREFIX,
    assert_completion_exact,
    corrupt_objects,
    http_post,
    r3_server,
    serve_flags,
    store_objects,
)
from utils.shm import small_tmpfs

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / ".cache" / "logs" / "r3-faults.jsonl"
CHILD = ROOT / "tests" / "artifact_connector" / "shm_child.py"
ERROR_PREFIX = "routed experts unavailable: "
# The store's typed errors a request may carry (store.py, request_core.py).
TYPED = (
    "StoreCapacityError",
    "ObjectMissingError",
    "ChecksumMismatchError",
    "StoreIOError",
    "StoreClosedError",
    "CoverageError",
    "EnvelopeError",
)


def _record(case: str, **fields) -> None:
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    with open(TABLE, "a") as f:
        f.write(json.dumps({"case": case, **fields}) + "\n")


def _prompt(tag: str, repeat: int = 1) -> str:
    """A prompt of ``repeat`` times the shared text, led by ``tag`` so its
    blocks hash differently from every other test's."""
    return f"[{tag}] " + SHARED_PREFIX * repeat


def _complete(server, prompt: str, max_tokens: int = 8, timeout: float = 120):
    return http_post(
        server.base_url,
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=timeout,
    )


def _typed_error(status: int, body: dict) -> str:
    """The error type of a failed R3 answer (asserting it is one)."""
    assert status == 500, (status, body)
    message = body["error"]["message"]
    assert message.startswith(ERROR_PREFIX), message
    kind = message[len(ERROR_PREFIX) :].split(":", 1)[0]
    assert kind in TYPED, message
    return kind


def _exact_or_typed(tiny_moe, status: int, body: dict) -> str:
    """``"exact"`` for exact routes, else the typed error's name."""
    if status == 200:
        assert_completion_exact(tiny_moe, body)
        return "exact"
    return _typed_error(status, body)


def _following(server, tiny_moe, tag: str) -> list[str]:
    """Three fresh requests after a fault: how each was answered."""
    return [
        _exact_or_typed(tiny_moe, *_complete(server, _prompt(f"{tag}-after-{i}")))
        for i in range(3)
    ]


def _assert_exact(server, tiny_moe, prompt: str, **kw) -> None:
    status, body = _complete(server, prompt, **kw)
    assert status == 200, body
    assert_completion_exact(tiny_moe, body)


def _healthy(server) -> bool:
    import urllib.request

    with urllib.request.urlopen(server.base_url + "/health", timeout=30) as r:
        return r.status == 200


def _tree(path: str) -> dict[str, int]:
    """Every file under ``path`` with its size (what a fault left there)."""
    found = {}
    for dirpath, _, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                found[os.path.relpath(full, path)] = os.path.getsize(full)
    return found


class _Running:
    """A long streamed completion in a thread. A test freezes the engine
    once ``decoding`` tokens have arrived (:func:`_frozen_mid_run`), so a
    fault made while frozen lands mid-run however fast the machine decodes
    (a 700-token request once finished between its objects' publication
    and a pause, on a loaded CI machine). ``result`` is (status, body) as a
    non-streamed completion would answer: the choice assembled from the
    chunks, or the stream's error event; or the exception that ended the
    stream (the server died under it)."""

    decoding = 8  # tokens streamed before a freeze: the gathered full blocks
    # have been handed to the publication thread (GATHER_STEPS is 4)

    def __init__(self, server, prompt: str, max_tokens: int = 700):
        self.result: object = None
        self._streamed = 0
        self._decoding = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(server, prompt, max_tokens), daemon=True
        )
        self._thread.start()

    def _run(self, server, prompt, max_tokens):
        try:
            self.result = self._stream(server, prompt, max_tokens)
        except Exception as e:
            self.result = e
        finally:
            self._decoding.set()

    def _stream(self, server, prompt, max_tokens):
        import httpx

        body = {
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "stream": True,
        }  # fmt: skip
        choice: dict = {"token_ids": []}
        with httpx.stream(
            "POST", server.base_url + "/v1/completions", json=body, timeout=300
        ) as resp:
            if resp.status_code != 200:
                return resp.status_code, json.loads(resp.read() or b"{}")
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return 200, {"choices": [choice]}
                event = json.loads(data)
                if "error" in event:
                    return 500, event
                (part,) = event["choices"]
                choice["token_ids"] += part.get("token_ids") or []
                for field in ("prompt_token_ids", "routed_experts"):
                    if part.get(field) is not None:
                        choice[field] = part[field]
                self._streamed = len(choice["token_ids"])
                if self._streamed >= self.decoding:
                    self._decoding.set()
        raise ConnectionError("the stream ended without [DONE]")

    def wait_decoding(self, timeout: float = 120) -> None:
        assert self._decoding.wait(timeout), "the request never started decoding"
        assert self.alive(), f"the request ended before decoding: {self.result}"

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float = 300):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the request never ended"
        return self.result


@contextlib.contextmanager
def _frozen(server):
    """The engine's running requests frozen in place (``/pause?mode=keep``)
    for the body, then resumed."""
    status, body = http_post(server.base_url, "/pause?mode=keep&clear_cache=false")
    assert status == 200, body
    try:
        yield
    finally:
        status, body = http_post(server.base_url, "/resume")
        assert status == 200, body


@contextlib.contextmanager
def _frozen_mid_run(server, run: _Running):
    """``run`` started decoding, then the engine frozen: the body runs while
    the request is certainly mid-run (hundreds of its tokens still to come,
    none computed while frozen); resumed after."""
    run.wait_decoding()
    with _frozen(server):
        assert run.alive(), f"the request ended before the freeze: {run.result}"
        yield


def _wait_new_objects(root: str, before: set[str], n: int, timeout: float = 60):
    """Objects published since ``before`` (at least ``n`` of them)."""
    deadline = time.monotonic() + timeout
    while True:
        new = [(k, p) for k, p in store_objects(root) if k not in before]
        if len(new) >= n:
            return new
        assert time.monotonic() < deadline, f"only {len(new)} objects published"
        time.sleep(0.02)


# ------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def tmpfs_dir():
    """A 2 MiB tmpfs under /dev/shm: a ``/dev/shm`` that can really be
    filled."""
    with small_tmpfs("2m") as mnt:
        yield mnt


@pytest.fixture(scope="module")
def server(tmpfs_dir, tiny_moe):
    root = os.path.join(tmpfs_dir, "store")
    # 1 MiB of capacity: 64 KiB arenas, so the filler below leaves the
    # store no room to grow, while capacity alone never evicts here.
    flags = serve_flags(root, capacity_bytes=1 << 20)
    with r3_server(tiny_moe, flags, root, "test-r3-faults.log") as srv:
        yield srv
    _record("shared server shutdown", left_on_tmpfs=_tree(tmpfs_dir))


def _fill(path: str) -> int:
    """Write a filler file into ``path`` until its file system is full;
    returns its size."""
    fd = os.open(os.path.join(path, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    size = 0
    try:
        while True:
            size += os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == 28, e  # ENOSPC
    finally:
        os.close(fd)
    return size


# ------------------------------------------------------------------ 1
def test_dev_shm_full_during_publication(server, tmpfs_dir, tiny_moe):
    _assert_exact(server, tiny_moe, _prompt("enospc-warm"))
    filler = _fill(tmpfs_dir)
    seen = []
    failed = None
    try:
        # Long prompts (28 blocks each): the index log needs a new page, or
        # an arena a new one, within a few requests.
        for i in range(12):
            prompt = _prompt(f"enospc-{i}", repeat=8)
            status, body = _complete(server, prompt)
            seen.append(_exact_or_typed(tiny_moe, status, body))
            if status != 200:
                failed = prompt
                break
    finally:
        os.unlink(os.path.join(tmpfs_dir, "filler"))
    _record("1 /dev/shm full", filler_bytes=filler, answers=seen)
    assert failed is not None, f"the store never hit the full tmpfs: {seen}"
    assert seen[-1] == "StoreCapacityError", seen
    assert _healthy(server)
    # Room again: a new prompt is exact.
    _assert_exact(server, tiny_moe, _prompt("enospc-after"))
    # The failed prompt's KV blocks are cached. Whether their routes were
    # stored depends on which put met the full file system (the prompt's
    # blocks, or only the tail at the finish): a prefix hit on them is exact,
    # or a typed error until the prefix cache lets them go (here: a reset).
    again = _exact_or_typed(tiny_moe, *_complete(server, failed))
    assert again in ("exact", "ObjectMissingError"), again
    assert http_post(server.base_url, "/reset_prefix_cache")[0] == 200
    _assert_exact(server, tiny_moe, failed)
    _record("1 /dev/shm full: the failed prompt again", answer=again)


# ------------------------------------------------------------------ 2
def test_object_corrupted_while_its_request_runs(server, tiny_moe):
    before = {k for k, _ in store_objects(server.shm_root)}
    run = _Running(server, _prompt("corrupt-mid-run", repeat=2))
    with _frozen_mid_run(server, run):
        new = _wait_new_objects(server.shm_root, before, 2)
        corrupt_objects(server.shm_root, [place for _, place in new])
    status, body = run.join()
    kind = _typed_error(status, body)
    _record("2a object corrupted mid-run", answer=kind, objects=len(new))
    assert kind == "ChecksumMismatchError", body
    assert _healthy(server)
    _assert_exact(server, tiny_moe, _prompt("corrupt-after"))


def _mapped_read_only(pgid: int, path: str) -> bool:
    """Whether a process of the server maps ``path`` read-only (the
    scheduler's reader; the writer maps it read-write)."""
    for pid in _group_pids(pgid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            for line in f:
                if line.rstrip().endswith(path) and line.split()[1] == "r--s":
                    return True
    return False


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    pids.append(int(entry))
    return pids


def test_arena_deleted_while_its_request_runs(server, tiny_moe):
    """``rm`` of the arena file holding a running request's blocks. The
    writer notices in its upkeep, copies the retained objects out of its own
    mapping into another arena and retires the deleted one, so the request
    and the following ones are exact."""
    root = server.shm_root
    before = {k for k, _ in store_objects(root)}
    run = _Running(server, _prompt("unlink-mid-run", repeat=2))
    with _frozen_mid_run(server, run):
        new = _wait_new_objects(root, before, 2)
        (ns,) = os.listdir(root)
        arenas = sorted({aid for _, (aid, _) in new})
        paths = [os.path.join(root, ns, f"{aid:016x}.arena") for aid in arenas]
        mapped = [_mapped_read_only(server.proc.pid, p) for p in paths]
        for p in paths:
            os.unlink(p)
    answer = _exact_or_typed(tiny_moe, *run.join())
    following = _following(server, tiny_moe, "unlink")
    _record(
        "2b arena deleted mid-run",
        reader_had_it_mapped=mapped,
        answer=answer,
        following=following,
    )
    assert _healthy(server)
    assert following[-1] == "exact", following


# ------------------------------------------------------------------ 3
def test_store_directory_made_unreadable(server, tiny_moe):
    root = server.shm_root
    (ns,) = os.listdir(root)
    # chmod 000: root ignores permission bits, and the store works through
    # descriptors it already holds; nothing changes.
    os.chmod(os.path.join(root, ns), 0)
    os.chmod(root, 0)
    try:
        chmod_answer = _exact_or_typed(
            tiny_moe, *_complete(server, _prompt("chmod-000"))
        )
    finally:
        os.chmod(root, 0o700)
        os.chmod(os.path.join(root, ns), 0o700)
    _record("3a chmod 000 on the store", answer=chmod_answer)
    assert chmod_answer == "exact"

    # rm -rf of the store root while a request runs.
    before = {k for k, _ in store_objects(root)}
    run = _Running(server, _prompt("rmtree-mid-run", repeat=2))
    with _frozen_mid_run(server, run):
        _wait_new_objects(root, before, 2)
        shutil.rmtree(root)
    removed_answer = _exact_or_typed(tiny_moe, *run.join())
    following = _following(server, tiny_moe, "rmtree")
    _record(
        "3b store root removed mid-run",
        answer=removed_answer,
        following=following,
        root_now=_tree(root) if os.path.isdir(root) else None,
    )
    assert _healthy(server)

    # A regular file where the root was (a typo'd cleanup script, say).
    if os.path.isdir(root):
        shutil.rmtree(root)
    with open(root, "w") as f:
        f.write("not a directory\n")
    try:
        blocked = [
            _exact_or_typed(tiny_moe, *_complete(server, _prompt(f"file-{i}")))
            for i in range(2)
        ]
    finally:
        os.unlink(root)
    time.sleep(0.5)
    after_file = _following(server, tiny_moe, "file")
    _record(
        "3c a file in place of the store root",
        answers=blocked,
        following=after_file,
    )
    assert _healthy(server)
    assert following[-1] == "exact", following
    assert after_file[-1] == "exact", after_file


# ------------------------------------------------------------------ 4
def _child_writer(root: str, ns: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(CHILD), "writer", root, ns, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_stale_store_with_the_same_namespace(tmp_path):
    """Writer level (no engine): a real writer process SIGKILLed in the
    middle of a put leaves its store; a new writer of the same namespace
    must neither mix with it nor steal a live one."""
    import numpy as np

    from vllm.distributed.artifact_connector.shm import (
        ShmStoreReader,
        ShmStoreWriter,
        make_namespace,
    )
    from vllm.distributed.artifact_connector.store import (
        ObjectMissingError,
        UnsafeStoreError,
        checksum,
    )

    root = f"/dev/shm/vart-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    ns = make_namespace("stale")
    try:
        # 3 batches of 10 objects; killed inside the third put's fill.
        child = _child_writer(root, ns, "3", "10", "3000", "2", "after_data", "0")
        out, _ = child.communicate(timeout=120)
        assert child.returncode == -signal.SIGKILL, out
        left = _tree(os.path.join(root, ns))
        try:
            w = ShmStoreWriter(root, ns)
        except UnsafeStoreError as e:
            outcome = f"UnsafeStoreError: {e}"
            w = None
        _record(
            "4 writer: stale store of a SIGKILLed writer, same namespace",
            left_by_the_dead_writer=left,
            new_writer=outcome if w is None else "created",
        )
        assert w is not None, outcome
        try:
            r = ShmStoreReader(root, ns)
            sys.path.insert(0, str(CHILD.parent))
            from helpers import key, payload

            # Nothing of the dead writer's is served from the new store.
            old = payload(0, 3000)
            with pytest.raises(ObjectMissingError):
                r.read_into(
                    [key(0)],
                    np.array([checksum(old)], np.uint64),
                    np.zeros(3000, np.uint8),
                    np.array([[0, 3000, 0]]),
                )
            r.close()
        finally:
            w.close()
        # A live writer holding the namespace: refused, its store untouched.
        holder = _child_writer(root, ns, "1", "1", "100", "-1", "none", "1")
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().startswith("published 0")
            with pytest.raises(UnsafeStoreError, match="already exists"):
                ShmStoreWriter(root, ns)
            assert os.path.exists(os.path.join(root, ns, "index.log"))
        finally:
            holder.kill()
            holder.wait()
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------ 5
def _shm_in_use() -> set[str]:
    """Top-level /dev/shm entries any live process has open or mapped."""
    names = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            names |= _shm_of(int(entry))
    return names


def _shm_of(pid: int) -> set[str]:
    paths = set()
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/maps") as f:
            paths |= {line.split(None, 5)[-1].strip() for line in f}
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return {
        p[len("/dev/shm/") :].split("/", 1)[0].split(" ")[0]
        for p in paths
        if p.startswith("/dev/shm/")
    }


def _sigkill_all(srv) -> None:
    """SIGKILL every process of the server at once (API server, EngineCore,
    workers, resource tracker), as the OOM killer or a node agent would."""
    pgid = srv.proc.pid
    os.killpg(pgid, signal.SIGKILL)
    srv.proc.wait(timeout=60)
    deadline = time.monotonic() + 60
    while _group_pids(pgid):
        assert time.monotonic() < deadline, "the killed server's processes linger"
        time.sleep(0.1)
    srv.proc = None
    srv._log.close()


def test_engine_sigkilled_mid_run_and_restarted_on_the_same_root(tiny_moe, monkeypatch):
    from server import VllmServer

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # /pause, for _frozen

    root = f"/dev/shm/vart-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    flags = serve_flags(root)
    srv = VllmServer(tiny_moe, flags, log_name="test-r3-faults-killed.log")
    shm_before = set(os.listdir("/dev/shm"))
    srv.__enter__()
    try:
        _assert_exact(srv, tiny_moe, _prompt("kill-warm"))
        (dead_ns,) = os.listdir(root)
        before = {k for k, _ in store_objects(root)}
        run = _Running(srv, _prompt("kill-mid-run", repeat=2))
        with _frozen_mid_run(srv, run):
            _wait_new_objects(root, before, 2)
        # Killed right after the resume, so the engine dies stepping.
        _sigkill_all(srv)
        client_saw = run.join()
    finally:
        srv.stop()
    assert isinstance(client_saw, Exception), client_saw
    store_left = _tree(root)
    # What the killed processes left besides the store: entries new since
    # the server started that no live process uses (engine tests run one at
    # a time, under a lock, so no other engine started meanwhile).
    in_use = _shm_in_use()
    others_left = {
        n: os.path.getsize(f"/dev/shm/{n}")
        for n in sorted(set(os.listdir("/dev/shm")) - shm_before - in_use)
        if n.startswith(("psm_", "sem.mp-"))
    }
    assert store_left, "the killed engine's store should still be there"
    try:
        # A new engine on the same root: the dead engine's store (its writer
        # proven gone) is collected when the new store is created.
        restart = VllmServer(tiny_moe, flags, log_name="test-r3-faults-restart.log")
        with restart:
            names = os.listdir(root)
            assert dead_ns not in names and len(names) == 1, names
            _assert_exact(restart, tiny_moe, _prompt("kill-mid-run", repeat=2))
            _assert_exact(restart, tiny_moe, _prompt("kill-after"))
        assert not os.path.exists(root), _tree(root)
    finally:
        # vLLM's own shared memory (its message queues, psm_*) and
        # multiprocessing semaphores (sem.mp-*) are unlinked by the resource
        # tracker, which the SIGKILL took too: upstream's leftovers, not the
        # store's; recorded, then removed.
        for name in others_left:
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{name}")
        _record(
            "5 engine SIGKILLed mid-run, restarted on the same root",
            client_saw=f"{type(client_saw).__name__}: {client_saw}",
            store_left_by_the_kill=store_left,
            other_dev_shm_left_by_the_kill=others_left,
            after_restart_and_shutdown=_tree(root) if os.path.exists(root) else None,
        )
