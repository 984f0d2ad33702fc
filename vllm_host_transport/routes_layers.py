# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which entries of the routes' layer axis a trainer rank needs.

The routes' layer axis is every decoder layer of the model (index ``i`` is
decoder layer ``i``; a layer without a router holds zeros; MTP / next-n layers
are never in it). A trainer wants only the layers that have a router, and a
pipeline-parallel rank only those its stage builds::

    from vllm_host_transport.routes_layers import moe_layers, moe_layers_of_stage

    moe_layers(config)                     # every decoder layer with a router
    moe_layers_of_stage(config, 1, 4)      # those of pipeline stage 1 of 4
    moe_layers_of_stage(config, 1, 4, num_layers_in_first_pipeline_stage=3)

``config`` is the model's Hugging Face config: a dict, the path of its
``config.json`` or of the model directory, or a ``PretrainedConfig`` (read by
attribute name; transformers is never imported here). The pipeline split
follows megatron-core 0.16.1 (``get_num_layers_to_build`` and
``get_transformer_layer_offset``), whose option names the keyword arguments
carry; Megatron-LM's ``--decoder-first-pipeline-num-layers`` and
``--decoder-last-pipeline-num-layers`` set the first two. Numpy-free: stdlib
only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

# Every decoder layer has a router (no dense layers in these families).
_ALL_LAYERS_MOE = frozenset(
    {
        "mixtral",
        "phimoe",
        "olmoe",
        "granitemoe",
        "granitemoeshared",
        "gpt_oss",
        "minimax_m2",
        "dbrx",
    }
)
# Layer i has a router unless in mlp_only_layers, and when (i + 1) is a
# multiple of decoder_sparse_step (vLLM's qwen2_moe / qwen3_moe).
_QWEN_MOE = frozenset({"qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_vl_moe_text"})
# Layer i has a router when i >= first_k_dense_replace and i is a multiple of
# moe_layer_freq (vLLM's deepseek_v2: V2, V3, V3.2, Kimi-K2; glm4_moe_lite).
_FIRST_K_DENSE = frozenset(
    {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm4_moe_lite"}
)
# As above without moe_layer_freq (vLLM's glm4_moe ignores it).
_FIRST_K_DENSE_NO_FREQ = frozenset({"glm4_moe"})

_PIPELINE_LAYER_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}


def load_config(config: Any) -> Mapping[str, Any] | Any:
    """The config itself, or the parsed ``config.json`` a path names."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
        if not isinstance(loaded, dict):
            raise ValueError(f"{path} does not hold a JSON object")
        return loaded
    return config


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _text_config(config: Any) -> Any:
    """The language model's config: multimodal configs nest it."""
    config = load_config(config)
    if _get(config, "num_hidden_layers") is None:
        nested = _get(config, "text_config")
        if nested is not None:
            return nested
    return config


def num_decoder_layers(config: Any) -> int:
    """Length of the routes' layer axis: the config's ``num_hidden_layers``."""
    config = _text_config(config)
    n = _get(config, "num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"config has no usable num_hidden_layers ({n!r})")
    return n


def _model_type(config: Any) -> str:
    model_type = _get(config, "model_type")
    if isinstance(model_type, str) and model_type:
        return model_type
    archs = _get(config, "architectures") or []
    return str(archs[0]) if archs else ""


def moe_layers(config: Any) -> list[int]:
    """The decoder layers (indices into the routes' layer axis) with a router.

    Raises ``ValueError`` for a family whose rule is not known here, naming
    the config fields that would decide it.
    """
    config = _text_config(config)
    n = num_decoder_layers(config)
    model_type = _model_type(config)

    if model_type in _QWEN_MOE:
        step = int(_get(config, "decoder_sparse_step", 1) or 1)
        dense = {int(i) for i in (_get(config, "mlp_only_layers") or [])}
        if int(_get(config, "num_experts", 0) or 0) <= 0:
            return []
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]

    if model_type in _FIRST_K_DENSE or model_type in _FIRST_K_DENSE_NO_FREQ:
        experts = _get(config, "n_routed_experts", _get(config, "num_experts"))
        if experts is None:
            return []
        first_dense = int(_get(config, "first_k_dense_replace", 0) or 0)
        freq = 1
        if model_type in _FIRST_K_DENSE:
            freq = int(_get(config, "moe_layer_freq", 1) or 1)
        return [i for i in range(first_dense, n) if i % freq == 0]

    if model_type == "llama4_text" or model_type == "llama4":
        step = int(_get(config, "interleave_moe_layer_step", 1) or 0)
        return [i for i in range(n) if step > 0 and (i + 1) % step == 0]

    if model_type == "ernie4_5_moe":
        start = int(_get(config, "moe_layer_start_index", 0))
        end = int(_get(config, "moe_layer_end_index", n - 1))
        interval = int(_get(config, "moe_layer_interval", 1) or 1)
        return [i for i in range(start, min(end, n - 1) + 1) if (i + 1) % interval == 0]

    if model_type in _ALL_LAYERS_MOE:
        return list(range(n))

    raise ValueError(
        f"which decoder layers of model_type {model_type!r} have a router is not "
        "known here; the config fields that decide it in the families this module "
        "knows are mlp_only_layers and decoder_sparse_step (Qwen-MoE), "
        "first_k_dense_replace and moe_layer_freq (DeepSeek, GLM), "
        "interleave_moe_layer_step (Llama 4), moe_layer_start_index / "
        "moe_layer_end_index / moe_layer_interval (ERNIE 4.5); pass the layer "
        "list yourself (the layers whose routes rows are not all zero in a "
        "routes array of a long prompt are a check)"
    )


def _parse_pipeline_layout(layout: str | Sequence[Sequence[str]]) -> list[list[str]]:
    """Megatron's ``pipeline_model_parallel_layout`` as one list of layer
    kinds per virtual stage, in layer order (virtual stage v of pipeline
    rank r is entry ``v * pipeline_stages + r``)."""
    if not isinstance(layout, str):
        return [[str(kind).strip().lower() for kind in stage] for stage in layout]
    text = layout.replace(",", "")
    # "(ab|c)*3" repeats the group, "t*3" the character (Megatron's syntax).
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages = []
    for part in text.split("|"):
        unknown = sorted(set(part) - set(_PIPELINE_LAYER_CHARS))
        if unknown:
            raise ValueError(
                f"pipeline layout {layout!r}: unknown layer chars {unknown}"
            )
        stages.append([_PIPELINE_LAYER_CHARS[c] for c in part])
    return stages


def stage_layers(
    num_layers: int,
    stage: int,
    stages: int,
    *,
    vp_stage: int | None = None,
    vp_stages: int | None = None,
    num_layers_in_first_pipeline_stage: int | None = None,
    num_layers_in_last_pipeline_stage: int | None = None,
    account_for_embedding_in_pipeline_split: bool = False,
    account_for_loss_in_pipeline_split: bool = False,
    pipeline_model_parallel_layout: str | Sequence[Sequence[str]] | None = None,
) -> list[int]:
    """The decoder layers pipeline stage ``stage`` of ``stages`` builds, as
    megatron-core 0.16.1 assigns them.

    With ``vp_stages`` (interleaved schedule), ``vp_stage`` picks one model
    chunk; ``vp_stage=None`` returns every chunk of the stage in chunk order,
    which is the order its routers are created in.
    """
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in 0..{stages - 1}")
    if pipeline_model_parallel_layout is not None:
        per_virtual = _parse_pipeline_layout(pipeline_model_parallel_layout)
        if len(per_virtual) % stages:
            raise ValueError(
                f"pipeline layout has {len(per_virtual)} virtual stages, "
                f"not a multiple of {stages} pipeline stages"
            )
        vp_total = len(per_virtual) // stages
        if sum(s.count("decoder") for s in per_virtual) != num_layers:
            raise ValueError(
                f"pipeline layout does not hold {num_layers} decoder layers"
            )
        chunks, next_layer = [], 0
        for index, kinds in enumerate(per_virtual):
            count = kinds.count("decoder")
            if index % stages == stage:
                chunks.append(list(range(next_layer, next_layer + count)))
            next_layer += count
        return _pick_chunk(chunks, vp_stage, vp_total)

    vp = vp_stages if (vp_stages is not None and stages > 1) else 1
    first, last = num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage
    if first is not None or last is not None:
        if (
            account_for_embedding_in_pipeline_split
            or account_for_loss_in_pipeline_split
        ):
            raise ValueError(
                "megatron-core does not combine an uneven first/last pipeline stage "
                "with account_for_embedding/loss_in_pipeline_split"
            )
        middle_stages = stages - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        if middle_layers < 0 or (middle_stages > 0 and middle_layers % middle_stages):
            raise ValueError(
                f"{middle_layers} layers left for {middle_stages} middle stages"
            )
        if middle_stages <= 0 and middle_layers:
            raise ValueError(
                f"{middle_layers} layers left and no middle pipeline stage"
            )
        per_middle = middle_layers // middle_stages if middle_stages > 0 else 0
        counts = [per_middle] * stages
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        slots = None
    else:
        # The embedding and the loss can each take the place of one layer in
        # the split: count them as slots, then drop them.
        slots = (
            ["embedding"] * account_for_embedding_in_pipeline_split
            + ["decoder"] * num_layers
            + ["loss"] * account_for_loss_in_pipeline_split
        )
        if len(slots) % stages:
            raise ValueError(
                f"{len(slots)} layers do not split evenly over {stages} stages"
            )
        counts = [len(slots) // stages] * stages
    for rank, count in enumerate(counts):
        if count % vp:
            raise ValueError(
                f"pipeline stage {rank} has {count} layers, not a multiple of "
                f"{vp} virtual stages"
            )
    # Layers go out chunk by chunk: virtual stage 0 of every rank, then 1, ...
    chunks, next_slot = [], 0
    for _ in range(vp):
        for rank in range(stages):
            size = counts[rank] // vp
            if rank == stage:
                chunks.append(list(range(next_slot, next_slot + size)))
            next_slot += size
    if slots is not None:
        shift = int(account_for_embedding_in_pipeline_split)
        chunks = [
            [i - shift for i in chunk if slots[i] == "decoder"] for chunk in chunks
        ]
    return _pick_chunk(chunks, vp_stage, vp)


def _pick_chunk(chunks: list[list[int]], vp_stage: int | None, vp: int) -> list[int]:
    if vp_stage is None:
        return [i for chunk in chunks for i in chunk]
    if not 0 <= vp_stage < vp:
        raise ValueError(f"vp_stage {vp_stage} is not in 0..{vp - 1}")
    return chunks[vp_stage]


def moe_layers_of_stage(
    config: Any,
    stage: int,
    stages: int,
    *,
    vp_stage: int | None = None,
    vp_stages: int | None = None,
    num_layers_in_first_pipeline_stage: int | None = None,
    num_layers_in_last_pipeline_stage: int | None = None,
    account_for_embedding_in_pipeline_split: bool = False,
    account_for_loss_in_pipeline_split: bool = False,
    pipeline_model_parallel_layout: str | Sequence[Sequence[str]] | None = None,
) -> list[int]:
    """The decoder layers with a router that pipeline stage ``stage`` of
    ``stages`` builds: absolute indices into the routes' layer axis, in the
    order Megatron creates their routers (``RouterReplay`` instances)."""
    config = _text_config(config)
    built = stage_layers(
        num_decoder_layers(config),
        stage,
        stages,
        vp_stage=vp_stage,
        vp_stages=vp_stages,
        num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
        account_for_embedding_in_pipeline_split=account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=pipeline_model_parallel_layout,
    )
    routed = set(moe_layers(config))
    return [i for i in built if i in routed]
