# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Producers and consumers of one scope in different PID namespaces (two
containers sharing ``/dev/shm``): a consumer that cannot see a producer's
process never takes it for dead. Real processes; the other namespace is
made with ``unshare --pid --fork --mount-proc`` (root only)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEER = "tests.host_transport.pidns_peer"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    return env


def _skip_unless_pid_namespaces() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a new PID namespace needs root and unshare(1)")
    r = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode:
        pytest.skip(f"unshare --pid refused here: {r.stderr.strip()[:300]}")


def _peer(what: str, refs: list[dict], other_namespace: bool) -> list[dict]:
    argv = [sys.executable, "-m", PEER, what, json.dumps(refs)]
    if other_namespace:
        argv = ["unshare", "--pid", "--fork", "--mount-proc", *argv]
    r = subprocess.run(
        argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in r.stdout.splitlines()]


def _fetch(refs: list[dict], other_namespace: bool) -> list[dict]:
    # The arrays' digests are for references of other producers (the
    # engine tests); these are the peer's own, checked by "ok".
    return [
        {k: v for k, v in r.items() if k != "sha256"}
        for r in _peer("fetch", refs, other_namespace)
    ]


def _ok(refs: list[dict]) -> list[dict]:
    return [{"key": r["key"], "ok": True, "error": ""} for r in refs]


def _objects(scope_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(scope_dir) if n.endswith(".rdm"))


def test_consumer_in_another_pid_namespace_leaves_live_producers_alone(
    scope: str,
) -> None:
    """A trainer in another container cannot see the producer's pid: it
    reads the payloads (as often as it likes) and removes nothing but what
    it releases; the producer's other payloads and its registration stay,
    and consumers of the producer's own namespace read them."""
    _skip_unless_pid_namespaces()
    producer = subprocess.Popen(
        [sys.executable, "-m", PEER, "produce", scope],
        cwd=ROOT,
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert producer.stdout is not None and producer.stdin is not None
        made = json.loads(producer.stdout.readline())
        refs = made["refs"]
        published = _objects(made["dir"])
        assert len(published) == 3, published

        # Every payload from the other namespace, twice (read-many).
        assert _fetch(refs + refs, other_namespace=True) == _ok(refs + refs)

        # Nothing went: the payloads and the producer's registration are
        # there, and a consumer of the producer's own namespace reads them.
        left = sorted(os.listdir(made["dir"]))
        assert _objects(made["dir"]) == published, left
        assert any(n.startswith("member-") for n in left), left
        assert _fetch(refs, other_namespace=False) == _ok(refs)

        # The other namespace's driver releases one payload: that one goes,
        # at once for every reader; nothing else does.
        assert _peer("release", refs[2:], other_namespace=True) == [{"removed": 1}]
        (gone,) = _fetch(refs[2:], other_namespace=False)
        assert gone["error"].startswith("RouteRefMissingError"), gone
        assert len(_objects(made["dir"])) == 2
        assert _fetch(refs[:2], other_namespace=True) == _ok(refs[:2])
        assert any(n.startswith("member-") for n in os.listdir(made["dir"]))
        assert producer.poll() is None
    finally:
        if producer.stdin is not None:
            producer.stdin.write("\n")
            producer.stdin.close()
        assert producer.wait(timeout=60) == 0
    # The producer's close withdrew the rest.
    assert not os.path.isdir(made["dir"]) or _objects(made["dir"]) == []


def test_a_join_sweeps_dead_producers_of_its_namespace_only(make_conn) -> None:  # noqa: ANN001
    """What a producer left is swept only when the looker can check it: a
    dead pid of this namespace goes, the same pid recorded in another
    namespace stays (it may run there), another boot's goes."""
    from vllm_host_transport.discovery import self_identity
    from vllm_host_transport.liveness import member_name

    first = make_conn()
    me = self_identity()
    gone_pid = 2**22 + 7  # above pid_max: no process has it
    here = me._replace(pid=gone_pid)
    there = here._replace(pid_ns=me.pid_ns + 1)
    old_boot = here._replace(boot="f" * 16 if me.boot != "f" * 16 else "e" * 16)
    names = [member_name(p, 1) for p in (here, there, old_boot)]
    for name in names:
        os.close(
            os.open(
                name, os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=first._shared.scope.fd
            )
        )
    first._shared.scope.advance_stamp()
    make_conn()  # a join looks
    left = set(os.listdir(first.scope_dir))
    assert names[0] not in left
    assert names[1] in left
    assert names[2] not in left


def test_a_foreign_producer_is_swept_only_past_its_ttl(make_conn) -> None:  # noqa: ANN001
    """A producer of another PID namespace cannot be checked: what it left
    goes once its registration is older than ``foreign_producer_ttl_s``
    (a running producer refreshes it), and not before."""
    import time

    from vllm_host_transport import perkey
    from vllm_host_transport.discovery import self_identity
    from vllm_host_transport.frame import RawFrame
    from vllm_host_transport.liveness import member_name

    first = make_conn()
    fd = first._shared.scope.fd
    me = self_identity()
    stale = me._replace(pid=4242, pid_ns=me.pid_ns + 1)
    fresh = me._replace(pid=4343, pid_ns=me.pid_ns + 1)
    for p, age in ((stale, 7200.0), (fresh, 0.0)):
        member = member_name(p, 1)
        os.close(os.open(member, os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
        when = time.time() - age
        os.utime(member, (when, when), dir_fd=fd)
        seg = f"{p.pid:032x}"
        frame = RawFrame(bytes(64))
        assert perkey.write_segment(fd, seg, b"k" * 16, frame, p)
    first._shared.scope.advance_stamp()
    make_conn()  # a join looks
    left = set(os.listdir(first.scope_dir))
    assert member_name(stale, 1) not in left
    assert f"{stale.pid:032x}.seg" not in left
    assert member_name(fresh, 1) in left
    assert f"{fresh.pid:032x}.seg" in left


def test_a_running_producer_refreshes_its_registration(make_conn, monkeypatch) -> None:  # noqa: ANN001
    """What tells a process of another namespace that a producer runs: its
    registration's mtime, refreshed by puts and by ``remove_dead()``."""
    import time

    from vllm_host_transport import sender as sendmod

    prod = make_conn()
    assert prod.put("p", "c", "k", 1)[0]
    fd = prod._shared.scope.fd
    (member,) = [n for n in os.listdir(fd) if n.startswith("member-")]
    old = time.time() - 7200
    os.utime(member, (old, old), dir_fd=fd)
    monkeypatch.setattr(sendmod, "HEARTBEAT_S", 0.0)
    prod.remove_dead()
    assert os.stat(member, dir_fd=fd).st_mtime > old + 3600
    os.utime(member, (old, old), dir_fd=fd)
    assert prod.put("p", "c", "k2", 2)[0]
    assert os.stat(member, dir_fd=fd).st_mtime > old + 3600
