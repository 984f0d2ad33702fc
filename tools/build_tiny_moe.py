#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build a tiny, deterministic Qwen3-MoE that vLLM and transformers both load.

Random weights from a fixed seed, a byte-level BPE tokenizer trained here on a
few sentences, and a ChatML chat template: no hub access is needed. Weights are
written with safetensors under the standard per-expert Hugging Face names, so
vLLM's Qwen3-MoE loader and transformers' (which fuses experts on load) both
read them. Router weights get a larger spread than the rest so tokens really
spread over the experts.

    python tools/build_tiny_moe.py --out .cache/models/tiny-moe
    python tools/build_tiny_moe.py --out DIR --layers 3 --experts 16 --top-k 4 \
        --dense-layers 1 --dtype bfloat16

Building is skipped when DIR already holds a model built with the same
parameters (recorded in ``build_params.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route every token to a few experts.",
    "Reinforcement learning needs the same routes in training and inference.",
    "A router picks the top k experts for each token in each layer.",
    "The prefix cache reuses key and value blocks across requests.",
    "Shared memory lets two processes on one node exchange bytes quickly.",
    "Hello, how are you today? I am fine, thank you.",
    "Once upon a time there was a tiny model that lived on a CPU.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text.",
    "Write a short poem about the sea and the sky.",
    "What is the capital of France? Paris is the capital of France.",
    "def add(a, b): return a + b",
    "The weather is sunny with a light breeze from the west.",
    "Tokens are executed in order; the last sampled token is never forwarded.",
    "Every block of thirty two tokens gets a hash that chains to its parent.",
    "Please summarise the following paragraph in one sentence.",
    "Experts, layers, tokens, routes, blocks, hashes, objects and stores.",
    "system user assistant: you are a helpful assistant.",
]


@dataclass
class TinyMoEParams:
    """Everything that determines the built model (recorded next to it)."""

    layers: int = 2
    experts: int = 8
    top_k: int = 2
    dense_layers: list[int] = field(default_factory=list)
    dtype: str = "float32"
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    moe_intermediate: int = 64
    dense_intermediate: int = 128
    vocab_target: int = 512
    max_position: int = 4096
    router_std: float = 0.5
    seed: int = 1234
    format_version: int = 1


def _train_tokenizer(out: Path, p: TinyMoEParams) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=p.vocab_target,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": p.max_position,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    )
    return tok.get_vocab_size()


def _weights(p: TinyMoEParams, vocab: int):
    import torch

    gen = torch.Generator().manual_seed(p.seed)
    dtype = getattr(torch, p.dtype)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    q_dim, kv_dim = p.heads * p.head_dim, p.kv_heads * p.head_dim
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, p.hidden)}
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        w[pre + "input_layernorm.weight"] = ones(p.hidden)
        w[pre + "post_attention_layernorm.weight"] = ones(p.hidden)
        w[pre + "self_attn.q_proj.weight"] = normal(q_dim, p.hidden)
        w[pre + "self_attn.k_proj.weight"] = normal(kv_dim, p.hidden)
        w[pre + "self_attn.v_proj.weight"] = normal(kv_dim, p.hidden)
        w[pre + "self_attn.o_proj.weight"] = normal(p.hidden, q_dim)
        w[pre + "self_attn.q_norm.weight"] = ones(p.head_dim)
        w[pre + "self_attn.k_norm.weight"] = ones(p.head_dim)
        if i in p.dense_layers:
            inter = p.dense_intermediate
            w[pre + "mlp.gate_proj.weight"] = normal(inter, p.hidden)
            w[pre + "mlp.up_proj.weight"] = normal(inter, p.hidden)
            w[pre + "mlp.down_proj.weight"] = normal(p.hidden, inter)
            continue
        w[pre + "mlp.gate.weight"] = normal(p.experts, p.hidden, std=p.router_std)
        for e in range(p.experts):
            ex = f"{pre}mlp.experts.{e}."
            w[ex + "gate_proj.weight"] = normal(p.moe_intermediate, p.hidden)
            w[ex + "up_proj.weight"] = normal(p.moe_intermediate, p.hidden)
            w[ex + "down_proj.weight"] = normal(p.hidden, p.moe_intermediate)
    w["model.norm.weight"] = ones(p.hidden)
    w["lm_head.weight"] = normal(vocab, p.hidden)
    return w


def _config(p: TinyMoEParams, vocab: int, eos_id: int, pad_id: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab,
        "hidden_size": p.hidden,
        "num_hidden_layers": p.layers,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads,
        "head_dim": p.head_dim,
        "intermediate_size": p.dense_intermediate,
        "moe_intermediate_size": p.moe_intermediate,
        "num_experts": p.experts,
        "num_experts_per_tok": p.top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(p.dense_layers),
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": p.dtype,
        "dtype": p.dtype,
    }


def build(out: str | os.PathLike, params: TinyMoEParams | None = None) -> Path:
    """Build the model into ``out`` (skipped when already built identically)."""
    p = params or TinyMoEParams()
    if p.top_k > p.experts or p.layers < 1 or p.experts < 1:
        raise ValueError(f"invalid tiny-MoE parameters: {p}")
    bad = [d for d in p.dense_layers if not 0 <= d < p.layers]
    if bad:
        raise ValueError(f"dense layers {bad} outside 0..{p.layers - 1}")
    out = Path(out)
    stamp = out / "build_params.json"
    wanted = json.dumps(asdict(p), sort_keys=True)
    if stamp.exists() and stamp.read_text() == wanted:
        return out

    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab = _train_tokenizer(tmp, p)
    tok = json.loads((tmp / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    config = _config(p, vocab, ids["<|im_end|>"], ids["<|endoftext|>"])
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(
        json.dumps({"eos_token_id": ids["<|im_end|>"], "do_sample": False})
    )
    save_file(_weights(p, vocab), str(tmp / "model.safetensors"), {"format": "pt"})
    stamp_tmp = tmp / "build_params.json"
    stamp_tmp.write_text(wanted)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument(
        "--dense-layers",
        default="",
        help="comma-separated indices of layers with a dense MLP (no router)",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    dense = [int(x) for x in a.dense_layers.split(",") if x.strip()]
    params = TinyMoEParams(
        layers=a.layers,
        experts=a.experts,
        top_k=a.top_k,
        dense_layers=dense,
        dtype=a.dtype,
        seed=a.seed,
    )
    print(build(a.out, params))


if __name__ == "__main__":
    main()
