# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`make demo`: the routing picture, the error outside the venv, and the demo
end to end (real server, openai client, summary, picture, cleanup)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
TMP = ROOT / ".cache" / "tmp"


def _our_processes() -> set[int]:
    """PIDs of vLLM server, EngineCore and worker processes run from this
    checkout (their titles are ``vllm serve ...`` or ``VLLM::...``)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True)
    pids = set()
    for line in out.stdout.splitlines():
        pid, _, args = line.strip().partition(" ")
        if "vllm serve" not in args and not args.startswith("VLLM::"):
            continue
        try:
            cwd = Path(f"/proc/{pid}/cwd").resolve()
        except OSError:
            continue  # exited meanwhile
        if cwd.is_relative_to(ROOT):
            pids.add(int(pid))
    return pids


def left_in_cache_tmp(before: set[Path]) -> list[str]:
    """New ``.cache/tmp`` entries an engine run leaves behind: rendezvous
    files, and private run folders whose owner has exited. (Other work in the
    same checkout may add its own files there meanwhile; those do not count.)"""
    from harness_env import DIST_FILE_PREFIX, RUN_PREFIX, TMP, _alive

    left = []
    for path in sorted(set(TMP.iterdir()) - before):
        name = path.name
        if name.startswith(DIST_FILE_PREFIX):
            left.append(name)
        elif name.startswith(RUN_PREFIX):
            owner = name.rsplit("-", 2)[1]
            if not (owner.isdigit() and _alive(int(owner))):
                left.append(name)
    return left


def _requests():
    import demo

    rng = np.random.default_rng(0)
    return [
        demo.RoutedRequest(
            "completion", "Mixture of experts models route every token",
            rng.integers(0, 8, (24, 2, 2), dtype=np.uint8), 9, 16,
        ),
        demo.RoutedRequest(
            "chat completion", "What is the capital of France?",
            rng.integers(0, 8, (33, 2, 2), dtype=np.uint8), 18, 16,
        ),
    ]  # fmt: skip


def test_routing_figure_has_the_panels_a_reader_needs():
    import demo

    requests = _requests()
    fig = demo.routing_figure(requests, num_experts=8)
    routes_axes = [ax for ax in fig.axes if ax.images]
    load_axes = [ax for ax in fig.axes if "expert load" in ax.get_title()]
    assert len(routes_axes) == len(load_axes) == 2, "one pair of panels a request"
    for ax, load, req in zip(routes_axes, load_axes, requests):
        tokens, layers, top_k = req.routes.shape
        title = ax.get_title(loc="left")
        assert req.name in title and req.text in title
        counts = f"{req.prompt_tokens} prompt + {req.completion_tokens} generated"
        assert counts in title
        # tokens along x, one row per (layer, slot), the routes themselves
        image = ax.images[0].get_array()
        assert image.shape == (layers * top_k, tokens)
        np.testing.assert_array_equal(image[1], req.routes[:, 0, 1])
        np.testing.assert_array_equal(image[top_k], req.routes[:, 1, 0])
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels == ["layer 0 · slot 0", "layer 0 · slot 1",
                          "layer 1 · slot 0", "layer 1 · slot 1"]  # fmt: skip
        assert "token position" in ax.get_xlabel()
        # the line where generation starts
        starts = [ln.get_xdata()[0] for ln in ax.lines]
        assert req.prompt_tokens - 0.5 in starts
        # the load panel: one bar per expert per layer, heights = counts
        heights = [p.get_height() for p in load.patches]
        assert len(heights) == 8 * layers
        expected = np.bincount(req.routes[:, 0].ravel(), minlength=8)
        assert heights[:8] == expected.tolist()
        assert load.get_xlabel() == "expert ID"
    legend_labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend_labels == [f"expert {e}" for e in range(8)]


def test_routing_picture_is_readable_at_natural_size(tmp_path):
    import demo
    from PIL import Image

    path = tmp_path / "routing.png"
    demo.save_picture(path, _requests(), num_experts=8)
    with Image.open(path) as im:
        width, height = im.size
    # was 216x36 with no axes: at least a screen's width, ~400 px a request
    assert width >= 1200 and height >= 2 * 400, (width, height)


def test_demo_outside_the_venv_says_to_use_make_demo():
    """No site-packages (-S) stands in for a system Python without them."""
    proc = subprocess.run(
        [sys.executable, "-S", str(ROOT / "tools" / "demo.py")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "make demo" in proc.stderr
    assert "numpy" in proc.stderr


@pytest.mark.engine
def test_demo_prints_routes_writes_picture_and_stops_everything():
    picture = ROOT / ".cache" / "demo" / "routing.png"
    picture.unlink(missing_ok=True)
    before = _our_processes()
    tmp_before = set(TMP.iterdir())
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "demo.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for title in ("== completion", "== chat completion"):
        assert title in out
    assert out.count("(tokens x layers x top_k), dtype uint8") == 2
    assert out.count("layer 1: [") == 2  # per-layer expert counts of both
    # The completion again by reference, fetched by a process without vLLM.
    assert "fetched in another process (imports vllm or torch: no)" in out
    assert "equal to the inline routes: True" in out
    assert re.search(r"by reference [\d.]+ ms \(request\) \+ [\d.]+ ms \(fetch\)", out)
    assert picture.is_file() and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _our_processes() <= before, "the demo left server processes behind"
    left = left_in_cache_tmp(tmp_before)
    assert left == [], f"the demo left files in .cache/tmp: {left}"
