# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The independent oracle: Hugging Face transformers' own router, in float32.

For a token sequence, transformers computes the same model with
``output_router_logits=True``; each MoE layer's ``router_logits.topk(k)`` are
the routes vLLM must return, in the router's top-k order.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np


@functools.lru_cache(maxsize=4)
def _model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def hf_routes(model_dir: str | Path, token_ids: list[int]) -> np.ndarray:
    """Routes ``[len(token_ids), num_hidden_layers, top_k]`` by transformers:
    every decoder layer in order; a layer without a router (``mlp_only_layers``)
    is a zero row, as the R3 contract says."""
    import torch

    model = _model(str(model_dir))
    cfg = model.config
    top_k = cfg.num_experts_per_tok
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_router_logits=True)
    moe = iter(out.router_logits)
    zeros = torch.zeros(len(token_ids), top_k, dtype=torch.int64)
    layers = [
        zeros if i in dense else next(moe).topk(top_k, dim=-1).indices
        for i in range(cfg.num_hidden_layers)
    ]
    assert next(moe, None) is None, "more router outputs than MoE layers"
    return torch.stack(layers, dim=1).numpy()


def expected_r3(model_dir: str | Path, prompt_ids: list[int], output_ids: list[int]):
    """The R3 contract: one row per executed token (all but the last sampled)."""
    ids = list(prompt_ids) + list(output_ids)
    return hf_routes(model_dir, ids[:-1])
