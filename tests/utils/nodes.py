# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Two simulated nodes on one machine: each a network namespace and a mount
namespace of its own, with its own tmpfs at ``/dev/shm``, joined by a veth
pair whose two ends are the only addresses besides each node's loopback.

A node's namespaces are anonymous and held by one process (``unshare`` then
``sh``, waiting on its stdin): every process of the node joins them with
``nsenter``, and they vanish, with the veth, the addresses and the tmpfs,
once the holder and every process inside have exited. Nothing is named in
``/run/netns`` and nothing is created in this machine's own namespaces, so a
test killed halfway leaves nothing behind: the holder exits at the end of
its stdin, when the test process dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

# What a node needs from this machine: iproute2's ``ip`` and util-linux's
# ``unshare``, ``nsenter`` and ``mount``.
TOOLS = ("ip", "unshare", "nsenter", "mount")

# A node's holder: mount its private /dev/shm, bring its loopback up, say
# so, and keep the namespaces alive until its stdin ends.
_HOLD = (
    "mount -t tmpfs -o size={size},mode=1777 tmpfs /dev/shm && "
    "ip link set lo up && echo ready && read _"
)

REPO = Path(__file__).resolve().parents[2]


def _ns(pid: int | str, kind: str) -> int:
    return os.stat(f"/proc/{pid}/ns/{kind}").st_ino


class Node:
    """One simulated node: its own network and mount namespaces (a private
    tmpfs of ``shm_size`` at ``/dev/shm``), entered by every process started
    with :meth:`popen` or :meth:`run`."""

    def __init__(self, name: str, shm_size: str) -> None:
        self.name = name
        self.ip: str | None = None
        self.holder = subprocess.Popen(
            ["unshare", "--net", "--mount", "--propagation", "private",
             "sh", "-c", _HOLD.format(size=shm_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.holder.stdout is not None and self.holder.stderr is not None
        ready = self.holder.stdout.readline().strip()
        if ready != "ready":
            self.holder.wait(timeout=30)
            raise OSError(
                f"cannot make node {name}'s namespaces: "
                f"{self.holder.stderr.read().strip() or ready!r}"
            )
        # Never configure this machine's own namespaces by mistake.
        for kind in ("net", "mnt"):
            assert _ns(self.holder.pid, kind) != _ns("self", kind), kind
        self.net_ns = _ns(self.holder.pid, "net")
        self.procs: list[subprocess.Popen] = []

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run inside this node (working directory: the repository)."""
        return [
            "nsenter", f"--target={self.holder.pid}", "--net", "--mount",
            f"--wd={REPO}", "--", *cmd,
        ]  # fmt: skip

    def run(self, cmd: Sequence[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(cmd), **kw)

    def popen(self, cmd: Sequence[str], **kw) -> subprocess.Popen:
        """A process inside this node, in a process group of its own (so
        that what it spawns can be stopped with it); stopped at
        :meth:`close` if still running."""
        proc = subprocess.Popen(self.argv(cmd), start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        """Stop what still runs inside (its process group, by id), then the
        holder: the namespaces, the veth end and the tmpfs go with them."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)  # a frozen master
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        assert self.holder.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.holder.stdin.close()
        try:
            self.holder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.holder.kill()
            self.holder.wait(timeout=30)
        for f in (self.holder.stdout, self.holder.stderr):
            if f is not None:
                f.close()

    def members(self) -> list[int]:
        """Processes of this machine still in this node's network namespace."""
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if _ns(entry, "net") == self.net_ns:
                        found.append(int(entry))
        return found


def unavailable() -> str | None:
    """Why simulated nodes cannot be made here (``None`` when they can)."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return (
            f"{', '.join(missing)} not found (iproute2 and util-linux provide "
            "them: apt-get install -y iproute2 util-linux mount)"
        )
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    return None


def _check(r: subprocess.CompletedProcess, what: str) -> None:
    if r.returncode:
        raise OSError(f"{what}: {r.stderr.strip() or r.returncode}")


@contextlib.contextmanager
def two_nodes(
    subnet: str = "10.231.29", shm_size: str = "2g"
) -> Iterator[tuple[Node, Node]]:
    """Nodes ``a`` (``<subnet>.1``) and ``b`` (``<subnet>.2``) on a /30,
    joined by a veth pair created directly inside their namespaces. Both
    are gone (every process inside stopped, no namespace member left) when
    the block ends, also on failure."""
    nodes: list[Node] = []
    with contextlib.ExitStack() as stack:
        stack.callback(_all_gone, nodes)
        for name in ("a", "b"):
            nodes.append(Node(name, shm_size))
            stack.callback(nodes[-1].close)
        a, b = nodes
        _check(
            subprocess.run(
                ["ip", "link", "add", "veth-a", "netns", str(a.holder.pid),
                 "type", "veth", "peer", "name", "veth-b",
                 "netns", str(b.holder.pid)],
                capture_output=True, text=True,
            ),
            "cannot create the veth pair between the nodes",
        )  # fmt: skip
        for node, dev, host in ((a, "veth-a", 1), (b, "veth-b", 2)):
            node.ip = f"{subnet}.{host}"
            for cmd in (
                ["ip", "addr", "add", f"{node.ip}/30", "dev", dev],
                ["ip", "link", "set", dev, "up"],
            ):
                _check(node.run(cmd), f"node {node.name}: {' '.join(cmd)}")
        yield a, b


def _all_gone(nodes: list[Node]) -> None:
    deadline = time.monotonic() + 30
    while left := {n.name: n.members() for n in nodes if n.members()}:
        assert time.monotonic() < deadline, f"processes left in the nodes: {left}"
        time.sleep(0.2)


def _die_with_parent() -> None:
    """In the child before exec: killed when the test process dies (a
    process that does not read its stdin would otherwise outlive a killed
    test, and keep its node's namespaces)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# A connection attempt from inside a node, until accepted or the deadline.
_PROBE = r"""
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + float(sys.argv[3])
while True:
    with socket.socket() as s:
        s.settimeout(1.0)
        if s.connect_ex((host, port)) == 0:
            sys.exit(0)
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(0.05)
"""


def wait_listening(node: Node, host: str, port: int, timeout_s: float = 30) -> bool:
    """Whether ``host:port`` accepts a connection from inside ``node``
    within ``timeout_s``."""
    r = node.run([sys.executable, "-c", _PROBE, host, str(port), str(timeout_s)])
    return r.returncode == 0


# Where a Mooncake Store holds objects: the transfer endpoints of each key's
# replicas, by a client of its own (it contributes no memory).
_LOCATE = r"""
import json, sys
from mooncake.store import MooncakeDistributedStore
me, master, keys = sys.argv[1], sys.argv[2], sys.argv[3:]
store = MooncakeDistributedStore()
assert store.setup(me, "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", master) == 0
where = {}
for key in keys:
    where[key] = [
        r.get_memory_descriptor().buffer_descriptor.transport_endpoint
        for r in store.get_replica_desc(key) if r.is_memory_replica()
    ]
store.close()
print(json.dumps(where))
"""


def replica_hosts(node: Node, master: str, keys: list[str]) -> dict[str, list[str]]:
    """The addresses of the nodes whose memory holds each key's replicas
    (asked from inside ``node``)."""
    assert node.ip is not None
    env = dict(os.environ, MC_FORCE_TCP="true")
    r = node.run([sys.executable, "-c", _LOCATE, node.ip, master, *keys], env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    where = json.loads(r.stdout.strip().splitlines()[-1])
    return {k: [e.rsplit(":", 1)[0] for e in v] for k, v in where.items()}


class NodeMaster:
    """A ``mooncake_master`` inside ``node``, listening on the node's address
    only (RPC and metrics); stopped and started again on the same port."""

    RPC_PORT = 50051  # the node's own network namespace: every port is free
    METRICS_PORT = 9003

    def __init__(self, node: Node, probe_from: Node, log: Path) -> None:
        assert node.ip is not None
        self.node = node
        self.host: str = node.ip
        self.probe_from = probe_from
        self.address = f"{node.ip}:{self.RPC_PORT}"
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        from utils.mooncake import MASTER

        env = dict(os.environ, MC_FORCE_TCP="true")
        with open(self.log, "ab") as log:
            self.proc = self.node.popen(
                [str(MASTER), f"--rpc_address={self.host}",
                 f"--rpc_port={self.RPC_PORT}", f"--metrics_host={self.host}",
                 f"--metrics_port={self.METRICS_PORT}"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        # Reached from the other node, over the veth.
        ok = wait_listening(self.probe_from, self.host, self.RPC_PORT)
        assert self.proc.poll() is None, f"mooncake_master exited (see {self.log})"
        assert ok, f"mooncake_master did not listen on {self.address}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.proc = None

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)


DRIVER = Path(__file__).resolve().parent / "node_engine.py"


class _LinesProcess:
    """A process inside a node that answers each JSON line on its stdin
    with one JSON line on its stdout (read on a thread of ours, so that an
    answer that never comes fails the test instead of hanging it)."""

    def __init__(self, node: Node, argv: list[str], log: Path, env: dict) -> None:
        self.node = node
        self.log = log
        self._log = open(log, "ab")  # noqa: SIM115 (closed in close())
        self.proc = node.popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True, env=env,
        )  # fmt: skip
        self._answers: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._answers.put(line)
        self._answers.put("")  # the process exited

    def answer(self, timeout_s: float) -> dict:
        try:
            line = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(
                f"node {self.node.name}: no answer in {timeout_s} s (see {self.log})"
            ) from None
        assert line, f"node {self.node.name}: the process exited (see {self.log})"
        return json.loads(line)

    def send(self, job: dict, timeout_s: float = 300) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self.answer(timeout_s)

    def close(self, last_line: str | None = None) -> None:
        """End its stdin (after ``last_line``) and wait; its process group
        is stopped if it does not exit within a minute."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError):
                if last_line is not None:
                    self.proc.stdin.write(last_line + "\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        self._log.close()


class EngineOnNode(_LinesProcess):
    """An offline ``LLM`` running inside ``node`` (tests/utils/node_engine.py).
    :meth:`generate` returns objects shaped like vLLM's ``RequestOutput``
    (``prompt_token_ids``, ``num_cached_tokens``, ``outputs[0]`` with
    ``token_ids``, ``routed_experts``, ``routed_experts_error`` and
    ``routed_experts_ref``, the reference's JSON), so that the oracle's
    assertions take them as they are."""

    def __init__(self, node: Node, spec: dict, log: Path, env: dict) -> None:
        super().__init__(
            node, [sys.executable, str(DRIVER), json.dumps(spec)], log, env
        )

    def wait_ready(self, timeout_s: float = 300) -> None:
        self._call(None, timeout_s)

    def _call(self, job: dict | None, timeout_s: float = 300) -> dict:
        got = self.answer(timeout_s) if job is None else self.send(job, timeout_s)
        assert "error" not in got, f"node {self.node.name}: {got['error']}"
        return got

    def generate(
        self, prompts: list[str], max_tokens: int, format: str = "inline"
    ) -> list[SimpleNamespace]:
        job = dict(op="generate", prompts=prompts, max_tokens=max_tokens, format=format)
        return [_request_output(o) for o in self._call(job)["outputs"]]

    def metrics(self) -> dict[str, float]:
        return self._call({"op": "metrics"})["metrics"]

    def reset_prefix_cache(self) -> bool:
        return self._call({"op": "reset_prefix_cache"})["ok"]

    def shutdown(self) -> None:
        self.close('{"op": "exit"}')


class TrainerOnNode(_LinesProcess):
    """The trainer's side inside ``node``: tests/utils/routes_consumer.py's
    consumer (``vllm_host_transport.routed_experts.fetch`` and Mooncake's
    client, never vLLM or torch), its Mooncake client on the node's
    address."""

    def __init__(self, node: Node, tmp: Path, log: Path) -> None:
        from utils.routes_consumer import CONSUMER

        assert node.ip is not None
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(MC_FORCE_TCP="true", VLLM_MOONCAKE_LOCAL_HOSTNAME=node.ip)
        super().__init__(node, [sys.executable, "-c", CONSUMER], log, env)
        self.tmp = tmp
        self.n = 0

    def fetch(self, ref: dict, timeout_s: float = 120):
        """The fetched array, or the name of the error ``fetch`` raised."""
        import numpy as np

        self.n += 1
        out = self.tmp / f"routes-{self.n}.npy"
        got = self.send({"ref": ref, "out": str(out)}, timeout_s)
        assert got["loaded"] == [], f"the trainer imported {got['loaded']}"
        if "error" in got:
            return got["error"]
        routes = np.load(out)
        out.unlink()
        return routes


def _request_output(o: dict) -> SimpleNamespace:
    import base64
    import io

    import numpy as np

    routes = None
    if o["routes"] is not None:
        routes = np.load(io.BytesIO(base64.b64decode(o["routes"])))
    completion = SimpleNamespace(
        token_ids=o["token_ids"],
        finish_reason=o["finish_reason"],
        routed_experts=routes,
        routed_experts_error=o["error"],
        routed_experts_ref=o["ref"],
    )
    return SimpleNamespace(
        prompt_token_ids=o["prompt_token_ids"],
        num_cached_tokens=o["num_cached_tokens"],
        outputs=[completion],
    )
