# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tiny MoE builder: deterministic, and loadable by transformers."""

from __future__ import annotations

import hashlib
import shutil

import pytest
from build_tiny_moe import TinyMoEParams, build
from harness_env import CACHE


@pytest.fixture
def out_dir(request):
    path = CACHE / "tmp" / f"tiny-{request.node.name}"
    yield path
    for p in (path, path.with_name(path.name + "-b")):
        shutil.rmtree(p, ignore_errors=True)


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_build_is_deterministic(out_dir):
    a = build(out_dir)
    b = build(out_dir.with_name(out_dir.name + "-b"))
    assert _digest(a) == _digest(b)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_variant_loads_in_transformers_with_dense_layers(out_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    params = TinyMoEParams(layers=3, experts=16, top_k=4, dense_layers=[1])
    path = build(out_dir, params)
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok("Hello, how are you today?", return_tensors="pt").input_ids
    out = model(ids, output_router_logits=True)
    # One router per MoE layer; the dense layer has none.
    assert len(out.router_logits) == 2
    assert out.router_logits[0].shape == (ids.shape[1], 16)


def test_invalid_parameters_are_refused(out_dir):
    with pytest.raises(ValueError, match="dense layers"):
        build(out_dir, TinyMoEParams(layers=2, dense_layers=[5]))
    with pytest.raises(ValueError, match="invalid"):
        build(out_dir, TinyMoEParams(experts=2, top_k=4))
