#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``make demo``: serve the tiny MoE with routed experts and show what comes back.

Builds the tiny model under ``.cache/``, starts ``vllm serve`` on 127.0.0.1 with
routed experts enabled, sends one completion and one chat request through the
official ``openai`` client, decodes the returned routes, prints a summary and
writes a picture of the routing (tokens x layers) to ``.cache/demo/``. The
server and all its children are stopped before the demo exits.
"""

from __future__ import annotations

import importlib.util
import json
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
        completion = client.completions.create(
            model=MODEL_NAME,
            prompt=COMPLETION_PROMPT,
            max_tokens=16,
            temperature=0.0,
        )
        chat = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": CHAT_MESSAGE}],
            max_tokens=16,
            temperature=0.0,
        )
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
