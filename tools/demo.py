#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``make demo``: serve the tiny MoE with routed experts and show what comes back.

Builds the tiny model under ``.cache/``, starts ``vllm serve`` on 127.0.0.1 with
routed experts enabled, sends one completion and one chat request through the
official ``openai`` client, decodes the returned routes, prints a summary and
writes a picture of the routing (tokens x layers) to ``.cache/demo/``. Then it
asks for the completion again by reference (``routed_experts_format: "ref"``),
fetches the routes in a separate process that imports neither vLLM nor torch
(as a trainer would), and prints whether the two arrays are equal and how long
each path took. The server and all its children are stopped before the demo
exits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = ("numpy", "openai", "matplotlib", "vllm")


def check_interpreter() -> None:
    """Exit with the fix when run outside the project venv (system Python)."""
    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"tools/demo.py: {', '.join(missing)} not found in {sys.executable}: "
            "this is not the project's venv. Run `make demo` (it creates .venv "
            "first), or `.venv/bin/python tools/demo.py` after `make setup`."
        )


if importlib.util.find_spec("numpy") is None:
    check_interpreter()

import numpy as np  # noqa: E402

sys.path.insert(0, str(ROOT / "tools" / "cpu_harness"))
sys.path.insert(0, str(ROOT / "tools"))

from build_tiny_moe import build  # noqa: E402
from harness_env import CACHE, apply_harness_env  # noqa: E402
from server import VllmServer  # noqa: E402

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MODEL_NAME = "tiny-moe"
SERVE_FLAGS = [
    "--served-model-name", MODEL_NAME,
    "--enable-routed-experts",
    "--dtype", "float32",
    "--block-size", "32",
    "--max-model-len", "1024",
    "--max-num-seqs", "8",
    "--enforce-eager",
]  # fmt: skip


# The trainer's side of a reference: this process imports neither vLLM nor
# torch (it says so if it did), fetches the routes and writes them to stdout
# as .npy bytes, the fetch's time on stderr.
FETCH_IN_ANOTHER_PROCESS = """
import io, json, sys, time
import numpy as np
from vllm_host_transport.routed_experts import fetch
ref = json.load(sys.stdin)
t = time.perf_counter()
routes = fetch(ref)
took = time.perf_counter() - t
heavy = sorted(m for m in ("vllm", "torch") if m in sys.modules)
buf = io.BytesIO()
np.save(buf, routes)
sys.stdout.buffer.write(buf.getvalue())
print(json.dumps({"fetch_s": took, "imported": heavy}), file=sys.stderr)
"""


def fetch_elsewhere(ref: dict) -> tuple[np.ndarray, float, list[str]]:
    """Fetch ``ref`` in a fresh interpreter, as a trainer process would;
    returns the routes, the fetch's seconds and the heavy modules it
    imported (none)."""
    import io

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    proc = subprocess.run(
        [sys.executable, "-c", FETCH_IN_ANOTHER_PROCESS],
        input=json.dumps(ref).encode(),
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.decode()[-2000:])
    info = json.loads(proc.stderr.decode().strip().splitlines()[-1])
    return np.load(io.BytesIO(proc.stdout)), info["fetch_s"], info["imported"]


def summarize(title: str, routes: np.ndarray, num_experts: int) -> str:
    lines = [
        f"== {title}",
        f"   routed_experts: shape {tuple(routes.shape)} "
        f"(tokens x layers x top_k), dtype {routes.dtype}",
        "   first rows (token: [layer0 experts] [layer1 experts] ...):",
    ]
    for t in range(min(4, routes.shape[0])):
        rows = " ".join(
            str(routes[t, layer].tolist()) for layer in range(routes.shape[1])
        )
        lines.append(f"     {t:3d}: {rows}")
    lines.append("   how often each expert was chosen, per layer:")
    for layer in range(routes.shape[1]):
        counts = np.bincount(routes[:, layer].ravel(), minlength=num_experts)
        lines.append(f"     layer {layer}: {counts.tolist()}")
    return "\n".join(lines)


@dataclass
class RoutedRequest:
    """One request's routes as the demo got them back."""

    name: str  # "completion", "chat completion"
    text: str  # its prompt or user message
    routes: np.ndarray  # [prompt + completion - 1, layers, top_k]
    prompt_tokens: int
    completion_tokens: int


def routing_figure(requests: list[RoutedRequest], num_experts: int) -> Figure:
    """One row of panels per request: the routes (tokens x layer/slot, colour =
    expert, a line where generation starts) and the expert load per layer."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.layout_engine import ConstrainedLayoutEngine
    from matplotlib.patches import Patch

    base = matplotlib.colormaps["tab10" if num_experts <= 10 else "tab20"]
    colors = [base(i % base.N) for i in range(num_experts)]
    cmap = ListedColormap(colors)
    layout = ConstrainedLayoutEngine(h_pad=0.15, hspace=0.08)
    fig = Figure(figsize=(14, 4.2 * len(requests) + 0.7), dpi=100, layout=layout)
    grid = fig.add_gridspec(len(requests), 2, width_ratios=[3.2, 1])
    for row, req in enumerate(requests):
        tokens, layers, top_k = req.routes.shape
        ax = fig.add_subplot(grid[row, 0])
        image = req.routes.transpose(1, 2, 0).reshape(layers * top_k, tokens)
        ax.imshow(
            image, cmap=cmap, vmin=-0.5, vmax=num_experts - 0.5,
            aspect="auto", interpolation="nearest",
        )  # fmt: skip
        ax.set_yticks(
            range(layers * top_k),
            [f"layer {lay} · slot {k}" for lay in range(layers) for k in range(top_k)],
        )
        for lay in range(1, layers):
            ax.axhline(lay * top_k - 0.5, color="white", linewidth=3)
        step = 1 if tokens <= 40 else max(1, tokens // 40 + 1)
        ax.set_xticks(range(0, tokens, step))
        ax.tick_params(axis="x", labelsize=8)
        ax.set_xlabel("token position (row of routed_experts)")
        ax.axvline(req.prompt_tokens - 0.5, color="black", linewidth=2.5)
        top = ax.secondary_xaxis("top")
        top.set_xticks(
            [(req.prompt_tokens - 1) / 2, (req.prompt_tokens + tokens - 1) / 2],
            ["◀ prompt ▶", "◀ generated ▶"],
        )
        top.tick_params(length=0, labelsize=10)
        text = req.text if len(req.text) <= 60 else req.text[:57] + "..."
        ax.set_title(
            f'{req.name}: "{text}"\n{req.prompt_tokens} prompt + '
            f"{req.completion_tokens} generated tokens = {tokens} rows "
            "(the last generated token is never run)",
            fontsize=11, loc="left",
        )  # fmt: skip
        ax_load = fig.add_subplot(grid[row, 1])
        counts = np.stack(
            [
                np.bincount(req.routes[:, lay].ravel(), minlength=num_experts)
                for lay in range(layers)
            ]
        )
        _load_panel(ax_load, counts, colors)
        ax_load.set_title(f"{req.name}: expert load per layer", fontsize=11)
    handles = [Patch(color=colors[e], label=f"expert {e}") for e in range(num_experts)]
    fig.legend(
        handles=handles, loc="outside lower center", ncol=min(num_experts, 16),
        title="colour = expert ID", fontsize=9, frameon=False,
    )  # fmt: skip
    return fig


def _load_panel(ax, counts: np.ndarray, colors: list) -> None:
    """Grouped bars: for each expert, how often each layer chose it."""
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    layers, num_experts = counts.shape
    hatches = ["", "///", "...", "xxx", "\\\\\\", "ooo", "---", "+++"]
    width = 0.8 / layers
    x = np.arange(num_experts)
    for lay in range(layers):
        ax.bar(
            x + (lay - (layers - 1) / 2) * width, counts[lay], width,
            color=[colors[e] for e in range(num_experts)], edgecolor="black",
            linewidth=0.6, hatch=hatches[lay % len(hatches)], label=f"layer {lay}",
        )  # fmt: skip
    ax.set_xticks(x)
    ax.set_xlabel("expert ID")
    ax.set_ylabel("times chosen (all slots)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(
        handles=[
            Patch(facecolor="white", edgecolor="black", hatch=hatches[lay % 8],
                  label=f"layer {lay}")
            for lay in range(layers)
        ],
        fontsize=8,
    )  # fmt: skip


def save_picture(path: Path, requests: list[RoutedRequest], num_experts: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    routing_figure(requests, num_experts).savefig(path)


COMPLETION_PROMPT = "Mixture of experts models route every token"
CHAT_MESSAGE = "What is the capital of France?"


def main() -> int:
    check_interpreter()
    apply_harness_env()
    import openai

    from vllm.utils.routed_experts_codec import decode_routed_experts

    model_dir = build(CACHE / "models" / "tiny-moe")
    num_experts = json.loads((model_dir / "config.json").read_text())["num_experts"]
    print(f"[demo] tiny MoE at {model_dir}; starting vllm serve (about 30 s on CPU)")
    t0 = time.monotonic()
    with VllmServer(model_dir, SERVE_FLAGS, log_name="demo-serve.log") as srv:
        took = time.monotonic() - t0
        print(f"[demo] server healthy at {srv.base_url} after {took:.1f} s")
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="EMPTY")

        def complete(**extra):
            """The demo's completion, and how long its request took."""
            t = time.perf_counter()
            out = client.completions.create(
                model=MODEL_NAME,
                prompt=COMPLETION_PROMPT,
                max_tokens=16,
                temperature=0.0,
                **extra,
            )
            return out, time.perf_counter() - t

        completion, inline_s = complete()
        chat = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": CHAT_MESSAGE}],
            max_tokens=16,
            temperature=0.0,
        )
        # The same completion by reference, fetched by another process
        # while the server runs (its payloads go when it stops).
        by_ref, ref_request_s = complete(extra_body={"routed_experts_format": "ref"})
        ref = (by_ref.choices[0].model_extra or {}).get("routed_experts_ref")
        if ref is None:
            print("[demo] ERROR: the by-reference response carries no reference")
            return 1
        fetched, fetch_s, imported = fetch_elsewhere(ref)
    results = []
    for title, text, choice, usage in (
        ("completion", COMPLETION_PROMPT, completion.choices[0], completion.usage),
        ("chat completion", CHAT_MESSAGE, chat.choices[0], chat.usage),
    ):
        extra = choice.model_extra or {}
        if extra.get("routed_experts") is None or usage is None:
            print(f"[demo] ERROR: the {title} response carries no routed_experts")
            return 1
        routes = decode_routed_experts(extra["routed_experts"])
        expected = usage.prompt_tokens + usage.completion_tokens - 1
        if routes.shape[0] != expected:
            print(f"[demo] ERROR: {routes.shape[0]} rows, expected {expected}")
            return 1
        print(
            summarize(
                f"{title} ({usage.prompt_tokens} prompt + "
                f"{usage.completion_tokens} generated tokens)",
                routes,
                num_experts,
            )
        )
        results.append(
            RoutedRequest(
                title, text, routes, usage.prompt_tokens, usage.completion_tokens
            )
        )
    t = time.perf_counter()
    inline = decode_routed_experts(
        (completion.choices[0].model_extra or {})["routed_experts"]
    )
    inline_s += time.perf_counter() - t
    same = fetched.shape == inline.shape and bool(np.array_equal(fetched, inline))
    print(
        f"[demo] by reference: {json.dumps(ref)[:160]}...\n"
        f"[demo] fetched in another process (imports vllm or torch: "
        f"{'yes: ' + ', '.join(imported) if imported else 'no'}): shape "
        f"{list(fetched.shape)}, equal to the inline routes: {same}\n"
        f"[demo] time: inline {inline_s * 1e3:.1f} ms (request + decode; the "
        f"server's first request, its warm-up included); by "
        f"reference {ref_request_s * 1e3:.1f} ms (request) + "
        f"{fetch_s * 1e3:.2f} ms (fetch)"
    )
    if not same or imported:
        print("[demo] ERROR: the by-reference hand-off did not give the inline routes")
        return 1
    picture = CACHE / "demo" / "routing.png"
    save_picture(picture, results, num_experts)
    print(
        "[demo] routing picture (per request: tokens x layer/slot coloured by "
        f"expert, and the expert load per layer): {picture}"
    )
    print("[demo] server stopped; done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
