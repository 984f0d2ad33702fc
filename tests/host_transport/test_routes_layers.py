# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""routes_layers: the decoder layers with a router, from real configs, and
the layers of a pipeline stage, checked against megatron-core 0.16.1's own
split (``get_num_layers_to_build`` / ``get_transformer_layer_offset``)."""

from __future__ import annotations

import importlib.util
import json
import types

import pytest

from vllm_host_transport.routes_layers import (
    moe_layers,
    moe_layers_of_stage,
    num_decoder_layers,
    stage_layers,
)

# The shape of DeepSeek-V3's config.json (the fields that decide its layers).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "num_nextn_predict_layers": 1,
}


def test_tiny_qwen3_moe_dir_and_file(tiny_moe):
    assert moe_layers(tiny_moe) == [0, 1]
    assert moe_layers(tiny_moe / "config.json") == [0, 1]
    assert num_decoder_layers(str(tiny_moe)) == 2


def test_tiny_qwen3_moe_with_dense_layers(tmp_path):
    from build_tiny_moe import TinyMoEParams, build

    model = build(tmp_path / "m", TinyMoEParams(layers=4, dense_layers=[0, 2]))
    assert moe_layers(model) == [1, 3]
    # Stage 1 of 2 builds layers 2 and 3; only 3 has a router.
    assert moe_layers_of_stage(model, 1, 2) == [3]


def test_pretrained_config_by_attribute(tiny_moe):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(tiny_moe)
    assert moe_layers(config) == [0, 1]
    config.mlp_only_layers = [1]
    assert moe_layers(config) == [0]


def test_qwen_sparse_step():
    config = {"model_type": "qwen2_moe", "num_hidden_layers": 6, "num_experts": 4}
    assert moe_layers({**config, "decoder_sparse_step": 2}) == [1, 3, 5]
    assert moe_layers({**config, "mlp_only_layers": [0, 5]}) == [1, 2, 3, 4]
    assert moe_layers({**config, "num_experts": 0}) == []


def test_deepseek_v3_shape():
    layers = moe_layers(DEEPSEEK_V3)
    assert layers == list(range(3, 61))  # the MTP layer (index 61) is never one
    assert moe_layers({**DEEPSEEK_V3, "moe_layer_freq": 2})[:3] == [4, 6, 8]
    # 61 layers over 4 stages: Megatron needs an uneven split, e.g. 16 + 15*3.
    first = moe_layers_of_stage(
        DEEPSEEK_V3, 0, 4, num_layers_in_first_pipeline_stage=16
    )
    assert first == list(range(3, 16))
    assert moe_layers_of_stage(
        DEEPSEEK_V3, 3, 4, num_layers_in_first_pipeline_stage=16
    ) == list(range(46, 61))


def test_glm_mixtral_llama4_multimodal():
    glm = {"model_type": "glm4_moe", "num_hidden_layers": 5, "n_routed_experts": 8}
    assert moe_layers({**glm, "first_k_dense_replace": 1, "moe_layer_freq": 2}) == [
        1,
        2,
        3,
        4,
    ]
    assert moe_layers({"model_type": "mixtral", "num_hidden_layers": 3}) == [0, 1, 2]
    llama4 = {
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text",
            "num_hidden_layers": 4,
            "interleave_moe_layer_step": 2,
        },
    }
    assert moe_layers(llama4) == [1, 3]


def test_unknown_architecture_names_the_fields():
    with pytest.raises(ValueError, match="first_k_dense_replace") as info:
        moe_layers({"model_type": "llama", "num_hidden_layers": 2})
    assert "'llama'" in str(info.value)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        moe_layers({"model_type": "mixtral"})


def test_stage_layers_by_hand():
    assert stage_layers(8, 1, 4) == [2, 3]
    # Interleaved: 8 layers, 2 stages, 2 chunks each -> [0,1][4,5] / [2,3][6,7].
    assert stage_layers(8, 1, 2, vp_stages=2) == [2, 3, 6, 7]
    assert stage_layers(8, 0, 2, vp_stages=2, vp_stage=1) == [4, 5]
    # The embedding takes a layer's place on stage 0, the loss on the last.
    assert stage_layers(
        6,
        0,
        4,
        account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True,
    ) == [0]
    assert stage_layers(
        6,
        3,
        4,
        account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True,
    ) == [5]
    assert stage_layers(7, 2, 3, num_layers_in_last_pipeline_stage=1) == [6]
    assert stage_layers(4, 1, 2, pipeline_model_parallel_layout="Ettt|tL") == [3]
    with pytest.raises(ValueError, match="split evenly"):
        stage_layers(7, 0, 2)
    with pytest.raises(ValueError, match="stage 4"):
        stage_layers(8, 4, 4)


# (num_layers, stages, vp_stages, first, last, embedding, loss)
SPLITS = [
    (8, 1, None, None, None, False, False),
    (8, 4, None, None, None, False, False),
    (8, 2, 2, None, None, False, False),
    (8, 2, 4, None, None, False, False),
    (6, 4, None, None, None, True, True),
    (7, 4, None, None, None, True, False),
    (14, 4, 2, None, None, True, True),
    (61, 4, None, 16, None, False, False),
    (61, 4, None, None, 13, False, False),
    (10, 4, None, 1, 3, False, False),
    (12, 4, 2, 2, 2, False, False),
    (6, 2, None, 5, None, False, False),
]


@pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="megatron-core is not installed (make setup installs 0.16.1 --no-deps)",
)
@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_stage_layers_match_megatron_core(split):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    num_layers, stages, vp, first, last, emb, loss = split
    # The fields these functions read, without building a whole TransformerConfig.
    mcore_config = types.SimpleNamespace(
        num_layers=num_layers,
        pipeline_model_parallel_size=stages,
        virtual_pipeline_model_parallel_size=vp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=emb,
        account_for_loss_in_pipeline_split=loss,
        pipeline_model_parallel_layout=None,
    )
    covered: list[int] = []
    for v in range(vp or 1):
        for stage in range(stages):
            vp_stage = v if vp else None
            count = get_num_layers_to_build(
                mcore_config, vp_stage=vp_stage, pp_rank=stage
            )
            offset = get_transformer_layer_offset(
                mcore_config, vp_stage=vp_stage, pp_rank=stage
            )
            ours = stage_layers(
                num_layers,
                stage,
                stages,
                vp_stage=vp_stage,
                vp_stages=vp,
                num_layers_in_first_pipeline_stage=first,
                num_layers_in_last_pipeline_stage=last,
                account_for_embedding_in_pipeline_split=emb,
                account_for_loss_in_pipeline_split=loss,
            )
            assert ours == list(range(offset, offset + count)), (v, stage)
            covered += ours
    assert sorted(covered) == list(range(num_layers))


@pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="megatron-core is not installed (make setup installs 0.16.1 --no-deps)",
)
@pytest.mark.parametrize(
    "layout,stages",
    [
        ("Ettt|tt|tt|tL", 4),
        ("Et|(tt|)*3,t|tL", 3),
        ([["embedding", "decoder"], ["decoder", "loss"]], 2),
        ("Ett|tt|tt|ttmL", 2),
    ],
    ids=str,
)
def test_pipeline_layout_matches_megatron_core(layout, stages, monkeypatch):
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    mcore_layout = PipelineParallelLayerLayout(layout, stages)
    vp = mcore_layout.virtual_pipeline_model_parallel_size
    # Megatron reads whether the schedule is interleaved from its global state.
    monkeypatch.setattr(
        parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: vp
    )
    num_layers = mcore_layout.flatten_layout.count(LayerType.decoder)
    for stage in range(stages):
        for v in range(vp):
            want = mcore_layout.get_layer_id_list(vp_stage=v, pp_rank=stage)
            got = stage_layers(
                num_layers,
                stage,
                stages,
                vp_stage=v,
                pipeline_model_parallel_layout=layout,
            )
            assert got == want, (stage, v)


def test_config_path_must_hold_an_object(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="JSON object"):
        moe_layers(path)
