# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/serve.py (``make serve``): serving by hand with the harness environment,
and the pruning of what engine runs leave in ``.cache/tmp``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"


def test_cpu_base_env_enables_mrv2_and_the_interpreter_and_keeps_caches_in():
    import serve

    env = serve.serve_env("cpu", environ={"PATH": "/usr/bin"})
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"  # else "requires MRV2"
    assert env["VLLM_FORK_CPU_HARNESS"] == "1"  # else "requires Triton"
    assert env["TRITON_INTERPRET"] == "1"
    keys = ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
            "VLLM_CACHE_ROOT", "HF_HOME", "XDG_CACHE_HOME", "MPLCONFIGDIR")  # fmt: skip
    for key in keys:
        assert Path(env[key]).is_relative_to(CACHE), (key, env[key])
    assert "HF_HUB_OFFLINE" not in env, "hand-served hub models may download"


def test_cuda_base_env_never_interprets_triton():
    import serve

    shell = {"VLLM_FORK_CPU_HARNESS": "1", "TRITON_INTERPRET": "1"}
    env = serve.serve_env("cuda", environ=shell)
    assert "VLLM_FORK_CPU_HARNESS" not in env and "TRITON_INTERPRET" not in env
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_user_settings_win():
    import serve

    env = serve.serve_env("cpu", environ={"VLLM_CPU_KVCACHE_SPACE": "8"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "8"


def test_command_passes_flags_through_and_defaults_to_loopback():
    import serve

    cmd = serve.serve_command(["some/model", "--enable-routed-experts"])
    assert Path(cmd[0]) == Path(sys.executable).with_name("vllm")
    assert cmd[1:] == ["serve", "some/model", "--enable-routed-experts",
                       "--host", "127.0.0.1"]  # fmt: skip
    cmd = serve.serve_command(["m", "--host=0.0.0.0"])
    assert cmd.count("--host") == 0 and "--host=0.0.0.0" in cmd


def test_tiny_moe_uses_the_demos_flags_and_port_8000_unless_given():
    import demo
    import serve

    cmd = serve.serve_command(["--tiny-moe"])
    assert cmd[2] == str(CACHE / "models" / "tiny-moe")
    assert cmd[3 : 3 + len(demo.SERVE_FLAGS)] == demo.SERVE_FLAGS
    assert cmd[cmd.index("--port") + 1] == "8000"
    cmd = serve.serve_command(["--tiny-moe", "--port", "9001"])
    assert cmd.count("--port") == 1 and cmd[cmd.index("--port") + 1] == "9001"


def test_outside_the_venv_the_wrapper_says_to_run_make_setup():
    proc = subprocess.run(
        [sys.executable, "-S", str(ROOT / "tools" / "serve.py"), "m"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "make setup" in proc.stderr and "Traceback" not in proc.stderr


def test_prune_removes_runs_whose_owner_is_gone_and_old_dist_files():
    import harness_env

    tmp = harness_env.TMP
    tmp.mkdir(parents=True, exist_ok=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp / f"run-test-{dead.pid}-deadbeef"
    live = tmp / f"run-test-{os.getpid()}-deadbeef"
    old = tmp / "vllm_dist_0123456789abcdef-test-old"
    new = tmp / "vllm_dist_0123456789abcdef-test-new"
    for d in (gone, live):
        (d / "sub").mkdir(parents=True, exist_ok=True)
        (d / "sub" / "f").write_text("x")
    for f in (old, new):
        f.write_text("")
    day = harness_env.STALE_DIST_FILE_S
    os.utime(old, (time.time() - day - 60,) * 2)
    try:
        removed = harness_env.prune_tmp()
        assert gone in removed and not gone.exists()
        assert old in removed and not old.exists()
        assert live.exists() and new.exists()
    finally:
        import shutil

        for d in (gone, live):
            shutil.rmtree(d, ignore_errors=True)
        for f in (old, new):
            f.unlink(missing_ok=True)


def test_wrapper_returns_the_servers_status_and_removes_its_tmpdir(monkeypatch):
    """main() with a stand-in for ``vllm serve`` that records its TMPDIR."""
    import serve

    record = CACHE / "tmp" / f"serve-test-{os.getpid()}.txt"
    code = (
        "import os, sys, pathlib; t = os.environ['TMPDIR']; "
        "open(os.path.join(t, 'vllm_dist_x'), 'w').close(); "
        f"pathlib.Path({str(record)!r}).write_text(t); sys.exit(3)"
    )
    seen = {}

    def fake_command(argv):
        # building the tiny model (torch) happens here: TMPDIR must be set
        seen["TMPDIR"] = os.environ["TMPDIR"]
        return [sys.executable, "-c", code]

    monkeypatch.setattr(serve, "serve_command", fake_command)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # main() sets its own
    try:
        assert serve.main(["m"]) == 3
        tmpdir = Path(record.read_text())
        assert seen["TMPDIR"] == str(tmpdir), "the wrapper itself wrote to /tmp"
        assert tmpdir.parent == CACHE / "tmp" and tmpdir.name.startswith("run-serve-")
        assert not tmpdir.exists(), "the wrapper left its TMPDIR behind"
    finally:
        record.unlink(missing_ok=True)


def _readme_block(marker: str) -> str:
    """The fenced block right after ``<!-- recipe: marker -->`` in README.md."""
    text = (ROOT / "README.md").read_text()
    after = text.split(f"<!-- recipe: {marker} -->", 1)[1]
    body = after.split("```", 2)[1]
    return body.split("\n", 1)[1]  # drop the language tag


@pytest.mark.engine
def test_readme_hand_serve_recipe_works_as_written():
    """README's `make serve` and its client code, unchanged but for the port
    (8000 may be taken on a shared machine); Ctrl-C stops everything."""
    from server import _group_alive, free_port
    from test_demo import left_in_cache_tmp

    server_cmd = _readme_block("server").split("#", 1)[0].split()
    assert server_cmd == ["make", "serve"]
    client_code = _readme_block("client")
    assert "127.0.0.1:8000" in client_code
    port = free_port()
    client_code = client_code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    tmp_before = set((CACHE / "tmp").iterdir())
    log_path = CACHE / "logs" / "test-readme-serve.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("w")
    proc = subprocess.Popen(
        [*server_cmd, "--no-print-directory", f"ARGS=--port {port}"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/health", timeout=2
                ):
                    break
            except OSError:
                assert time.monotonic() < deadline, "server not healthy in 300 s"
                time.sleep(0.5)
        client = subprocess.run(
            [sys.executable, "-c", client_code],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert client.returncode == 0, client.stderr[-3000:]
        shape_line = client.stdout.splitlines()[0]
        assert shape_line.endswith(", 2, 2) uint8"), client.stdout
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    deadline = time.monotonic() + 30
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(proc.pid), "server processes survived Ctrl-C"
    left = left_in_cache_tmp(tmp_before)
    assert left == [], f"hand-served run left files in .cache/tmp: {left}"
