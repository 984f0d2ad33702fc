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

import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools" / "cpu_harness"))
sys.path.insert(0, str(ROOT / "tools"))

from build_tiny_moe import build  # noqa: E402
from harness_env import CACHE, apply_harness_env  # noqa: E402
from server import VllmServer  # noqa: E402

MODEL_NAME = "tiny-moe"
SERVE_FLAGS = [
    "--served-model-name", MODEL_NAME,
    "--enable-return-routed-experts",
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


def save_picture(path: Path, routes: np.ndarray, num_experts: int) -> None:
    """One column per token, one band per layer, one row per top-k slot."""
    from PIL import Image

    tokens, layers, top_k = routes.shape
    palette = np.array(
        [
            [int(255 * c) for c in _hsv(i / max(num_experts, 1))]
            for i in range(num_experts)
        ],
        dtype=np.uint8,
    )
    cell, gap = 8, 4
    height = layers * (top_k * cell + gap) - gap
    canvas = np.full((height, tokens * cell, 3), 255, dtype=np.uint8)
    for layer in range(layers):
        for k in range(top_k):
            y = layer * (top_k * cell + gap) + k * cell
            colors = palette[routes[:, layer, k]]
            canvas[y : y + cell] = np.repeat(colors, cell, axis=0)[None, :, :]
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(canvas).save(path)


def _hsv(h: float) -> tuple[float, float, float]:
    import colorsys

    return colorsys.hsv_to_rgb(h, 0.75, 0.95)


def main() -> int:
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
            prompt="Mixture of experts models route every token",
            max_tokens=16,
            temperature=0.0,
        )
        chat = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0.0,
        )
    results = []
    for title, choice, usage in (
        ("completion", completion.choices[0], completion.usage),
        ("chat completion", chat.choices[0], chat.usage),
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
        results.append(routes)
    picture = CACHE / "demo" / "routing.png"
    save_picture(picture, results[0], num_experts)
    print(
        f"[demo] routing picture (tokens x layers x top-k, colour = expert): {picture}"
    )
    print("[demo] server stopped; done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
