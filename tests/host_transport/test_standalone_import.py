# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vllm_host_transport is a package of its own: a process (a trainer with
numpy only, or another vLLM version) imports it and takes payloads through it
without importing vLLM or torch.

Each child runs the venv's interpreter from a folder outside the repository,
in a fresh environment (the harness's cache folders, the CPU harness off)
whose only ``PYTHONPATH`` entry is the repository root; vllm and torch are
installed in that venv, so importing either would show in ``sys.modules``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from harness_env import harness_env

from vllm_host_transport import HostTransportConfig, HostTransportConnector
from vllm_host_transport.codec import FrameCodec

ROOT = Path(__file__).resolve().parents[2]

# Modules the child must not have loaded (the package's own names start with
# "vllm_", so they are not matched; a None entry is an import blocked).
NO_HEAVY = """
def heavy():
    return sorted(m for m, mod in sys.modules.items()
                  if mod is not None and m.split(".")[0] in ("torch", "vllm"))
"""


def child_env(pythonpath: bool = True) -> dict[str, str]:
    env = harness_env(enable_triton_interpreter=False)
    env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
    for name in ("HOME", "LANG"):
        if name in os.environ:
            env[name] = os.environ[name]
    if pythonpath:
        env["PYTHONPATH"] = str(ROOT)
    return env


def child_code(body: str) -> str:
    return "import sys\n" + NO_HEAVY + textwrap.dedent(body)


def run_child(
    body: str, cwd: Path, *args: str, pythonpath: bool = True
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", child_code(body), *args],
        cwd=cwd,
        env=child_env(pythonpath),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("pythonpath", [True, False], ids=["checkout", "installed"])
def test_every_module_imports_without_vllm_or_torch(tmp_path, pythonpath):
    """From the checkout, and (no PYTHONPATH) through the link `make setup`
    puts into the venv's site-packages."""
    proc = run_child(
        """
        import pkgutil

        import vllm_host_transport
        import vllm_host_transport.connector
        import vllm_host_transport.receiver

        names = [m.name for m in pkgutil.walk_packages(
            vllm_host_transport.__path__, "vllm_host_transport.")]
        for name in names:
            __import__(name)
        assert not heavy(), heavy()
        print(vllm_host_transport.__file__)
        print(" ".join(names))
        """,
        tmp_path,
        pythonpath=pythonpath,
    )
    assert proc.returncode == 0, f"(not linked? run `make setup`) {proc.stderr}"
    path, names = proc.stdout.splitlines()
    assert Path(path).resolve() == ROOT / "vllm_host_transport" / "__init__.py"
    assert {"vllm_host_transport.codec", "vllm_host_transport.safe_fs"} <= set(
        names.split()
    )


TRAINER = """
import json

import numpy as np

from vllm_host_transport import (
    HostTransportConfig, HostTransportConnector, receive_payload)

scope, ring, key = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with HostTransportConnector(
    HostTransportConfig(scope=scope, host_ring_bytes=ring)
) as conn:
    print("ready", flush=True)
    got = receive_payload(conn, "engine", "trainer", key, timeout_s=60)
    assert got is not None, "nothing received"
    experts = got["routed_experts"]
    assert type(experts) is np.ndarray and experts.dtype == np.int32
    assert experts.shape == (12, 4, 2) and not experts.flags.writeable
    assert got["meta"] == {"request_id": key, "tokens": [5, 6, 7]}
    reply = {"sum": np.array([experts.sum()], dtype=np.int64),
             "logprobs": got["logprobs"] * 2}
    ok = conn.put("trainer", "engine", key, reply)[0]
    assert ok, "reply not sent"
    # Stay alive (the reply's producer) until the engine has taken it.
    print(json.dumps({"heavy": heavy()}), flush=True)
    sys.stdin.readline()
assert not heavy(), heavy()
"""


def test_numpy_round_trip_with_a_process_that_never_imports_torch_or_vllm(
    scope, make_conn, ring_bytes, tmp_path
):
    """An engine-side process (this one, with torch and vllm loaded) sends
    numpy arrays to a trainer process that has neither; the trainer replies
    through the transport. Both rings and per-key segments."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", child_code(TRAINER), scope, str(ring_bytes), "req_3"],
        cwd=tmp_path,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert trainer.stdout is not None and trainer.stdin is not None

    def line() -> str:
        got = trainer.stdout.readline()
        if not got:  # the trainer ended
            trainer.wait(30)
            pytest.fail(f"trainer failed: {trainer.stderr.read()}")  # type: ignore
        return got

    try:
        assert line().strip() == "ready"
        engine = make_conn(ring_bytes)
        experts = np.arange(12 * 4 * 2, dtype=np.int32).reshape(12, 4, 2) % 64
        logprobs = np.linspace(-3, 0, 7, dtype=np.float32)
        payload = {
            "routed_experts": experts,
            "logprobs": logprobs,
            "meta": {"request_id": "req_3", "tokens": [5, 6, 7]},
        }
        assert engine.put("engine", "trainer", "req_3", payload)[0]
        report = json.loads(line())
        assert report["heavy"] == [], report
        got = engine.get_with_deadline(
            "trainer", "engine", "req_3", deadline=time.monotonic() + 60
        )
        assert got is not None
        reply = got[0]
        assert reply["sum"].tolist() == [int(experts.sum())]
        np.testing.assert_array_equal(reply["logprobs"], logprobs * 2)
        trainer.stdin.write("done\n")
        trainer.stdin.flush()
        assert trainer.wait(60) == 0, trainer.stderr.read()  # type: ignore
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(30)
        for stream in (trainer.stdin, trainer.stdout, trainer.stderr):
            if stream is not None:
                stream.close()


def frame_bytes(obj) -> bytes:
    """``obj`` encoded by this process (torch and vllm loaded) as one frame."""
    frame = FrameCodec(1 << 20, 4096).encode(obj)
    buf = bytearray(frame.total)
    frame.write_into(memoryview(buf))
    return bytes(buf)


CODEC = """
import pathlib

import msgspec
import numpy as np

from vllm_host_transport.codec import CorruptFrame, FrameCodec

frames = pathlib.Path(sys.argv[1])
if sys.argv[2] == "block":  # as where neither is installed
    sys.modules["torch"] = None
    sys.modules["vllm"] = None

class Step(msgspec.Struct):
    request_id: str
    tokens: list[int]
    routes: np.ndarray

codec = FrameCodec(1 << 20, 4096, struct_types=[Step])
out = {}
# Numpy arrays, structs and plain values, both ways, without torch or vllm.
payload = {"a": np.arange(6, dtype=np.float64).reshape(2, 3), "n": [1, "x", None],
           "s": Step("r", [1, 2], np.ones(3, np.uint8))}
frame = codec.encode(payload)
buf = bytearray(frame.total)
frame.write_into(memoryview(buf))
got = codec.decode(memoryview(buf))
assert got["a"].tolist() == payload["a"].tolist() and got["n"] == [1, "x", None]
assert got["s"].request_id == "r" and got["s"].routes.tolist() == [1, 1, 1]
got = codec.decode(memoryview((frames / "numpy").read_bytes()))
assert got["x"].tolist() == [[0, 1], [2, 3]]
out["numpy"] = heavy()
# A value only vLLM's serializer can carry.
try:
    codec.encode({"odd": slice(1, 2)})
    out["encode_serial"] = "encoded"
except TypeError as e:
    out["encode_serial"] = str(e)
for name in ("serial", "tensor", "tdict"):
    try:
        got = codec.decode(memoryview((frames / name).read_bytes()))
        out[name] = type(got).__name__
    except CorruptFrame as e:
        out[name] = "CorruptFrame: " + str(e)
out["heavy"] = heavy()
print(json.dumps(out))
"""


@pytest.fixture
def frames(tmp_path: Path) -> Path:
    folder = tmp_path / "frames"
    folder.mkdir()
    (folder / "numpy").write_bytes(
        frame_bytes({"x": np.arange(4, dtype=np.int16).reshape(2, 2)})
    )
    (folder / "serial").write_bytes(frame_bytes({"odd": slice(1, 2)}))
    (folder / "tensor").write_bytes(frame_bytes([torch.arange(3)]))
    (folder / "tdict").write_bytes(frame_bytes({"t": torch.arange(3)}))
    return folder


def run_codec(frames: Path, mode: str, cwd: Path) -> dict:
    code = "import json\n" + CODEC
    proc = subprocess.run(
        [sys.executable, "-c", child_code(code), str(frames), mode],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_without_torch_and_vllm_tensor_and_serializer_frames_fail_clearly(
    frames, tmp_path
):
    out = run_codec(frames, "block", tmp_path)
    assert out["numpy"] == []
    assert "<class 'slice'>" in out["encode_serial"]
    assert "vllm is not importable" in out["encode_serial"]
    assert out["serial"].startswith("CorruptFrame: ")
    assert "KIND_SERIAL" in out["serial"] and "vllm is not importable" in out["serial"]
    for name in ("tensor", "tdict"):
        assert "torch is not importable" in out[name], out[name]


def test_tensors_and_the_serializer_load_torch_and_vllm_only_when_met(frames, tmp_path):
    """Where torch and vllm are installed, a process that meets a tensor or
    a serializer frame imports them then (and only then) and decodes it."""
    out = run_codec(frames, "allow", tmp_path)
    assert out["numpy"] == []  # numpy, structs and plain values: neither
    assert out["encode_serial"] == "encoded"
    assert out["serial"] == "dict"
    assert out["tensor"] == "list" and out["tdict"] == "dict"
    assert "torch" in out["heavy"] and "vllm" in out["heavy"]


def test_connector_in_this_process_still_carries_tensors(make_conn):
    """Behaviour where torch is loaded: tensor dicts, tensors in trees."""
    c = make_conn(1 << 16)
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert c.put("p", "c", "k", {"t": t})[0]
    got = c.get("p", "c", "k")
    assert got is not None and torch.equal(got[0]["t"], t)
    assert c.put("p", "c", "k2", {"x": [t, np.ones(2)]})[0]
    got = c.get("p", "c", "k2")
    assert got is not None and torch.equal(got[0]["x"][0], t)
    assert HostTransportConfig  # the public names come from the package
    assert isinstance(c, HostTransportConnector)
