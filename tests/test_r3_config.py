# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ArtifactConfig (R3) as wired by patches/0003-artifact-config.patch.

The spellings of the switch (CLI flag and alias, ``--artifact-config``, the
older ``--aux-output-config``, the ``EngineArgs``/``LLM`` keywords) all end in
``VllmConfig.artifact_config``; its hash factor; and every startup rejection
of ``verify_artifact_config``, each with the fix in its message.

Only configurations are built here (``EngineArgs.create_engine_config``); no
engine starts. Where this CPU build rejects or resets a setting before the
verifier runs, the test builds a configuration that passes, changes one
attribute and calls ``verify_artifact_config`` directly; each such test says
why.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness_env import CACHE

import vllm.config.artifact_node as node_module
import vllm.config.artifact_settings as settings_module
import vllm.envs as envs
from vllm.config import AuxOutputConfig, ModelConfig, VllmConfig
from vllm.config.artifact import (
    MIN_CAPACITY_BYTES,
    MIN_INACTIVE_TTL_S,
    ArtifactConfig,
    check_prefix_caching_for_routed_experts,
    routed_experts_row_spec,
    verify_artifact_config,
)
from vllm.config.artifact_transfer import SHARED_SECRET_ENV, loads_shared_kv
from vllm.config.artifact_transfer import shared_secret as read_shared_secret
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

BASE_KWARGS = dict(block_size=32, dtype="float32", max_model_len=1024)
BASE_FLAGS = ["--block-size", "32", "--dtype", "float32", "--max-model-len", "1024"]

# Distinctive parts of the fix each rejection names.
FIX_V2 = "set VLLM_USE_V2_MODEL_RUNNER=1"
FIX_RUNNER = "serve the model with --runner generate"
FIX_MOE = "drop the flag for this model"
FIX_PREFIX = "remove --no-enable-prefix-caching"
FIX_PP = "use --tensor-parallel-size instead of --pipeline-parallel-size"
FIX_CP = "drop --decode-context-parallel-size/--prefill-context-parallel-size"
FIX_DBO = "drop --enable-dbo / --ubatch-size"
FIX_EXECUTOR = "use --distributed-executor-backend mp"
FIX_KV = (
    "CPU KV offload (OffloadingConnector or SimpleCPUOffloadConnector) "
    "with kv_role=kv_both, and ExampleConnector (shared storage, any role) "
    """with --artifact-config '{"backend": "mooncake", ...}' are supported"""
)
FIX_SHARED_KV = """set --artifact-config '{"backend": "mooncake", "key_space": ..."""
FIX_ADAPTIVE = "turn enable_adaptive_verification off in --speculative-config"
FIX_SHM_ROOT = "choose e.g. /dev/shm/vllm-artifacts-"
FIX_AUX = "enable routed experts with --enable-routed-experts"


def _build(model: Path, **kwargs) -> VllmConfig:
    args = EngineArgs(model=str(model), **{**BASE_KWARGS, **kwargs})
    return args.create_engine_config()


def _build_r3(model: Path, **kwargs) -> VllmConfig:
    return _build(model, enable_routed_experts=True, **kwargs)


def _rejects(fix: str):
    """pytest.raises for a ValueError (pydantic's ValidationError is one)
    whose message contains ``fix`` verbatim."""
    return pytest.raises(ValueError, match=re.escape(fix))


def _shm_name(tag: str) -> str:
    # The leak guard attributes names carrying this pid to this session.
    return f"/dev/shm/vart-test-{os.getpid()}-{tag}"


@pytest.fixture(autouse=True)
def _environment_restored():
    """Building some configs changes os.environ (the external_launcher
    executor sets VLLM_ENABLE_V1_MULTIPROCESSING=0); later engine tests must
    not inherit that."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _default_shm_root(monkeypatch):
    """Building a config creates its store root (r5 M4): the default one of
    these tests carries this session's pid and goes after each test."""
    default = _shm_name("default-root")
    monkeypatch.setattr(settings_module, "default_shm_root", lambda: default)
    yield
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(default)


@pytest.fixture(scope="module")
def parser() -> FlexibleArgumentParser:
    return EngineArgs.add_cli_args(FlexibleArgumentParser())


def _from_cli(parser, model: Path, *flags: str) -> VllmConfig:
    args = parser.parse_args(["--model", str(model), *BASE_FLAGS, *flags])
    return EngineArgs.from_cli_args(args).create_engine_config()


@pytest.fixture(scope="module")
def tiny_dense(tiny_moe) -> Path:
    """The tiny MoE's config turned into a dense Qwen3 (no router anywhere).
    No weights: no engine starts, building the config never reads them."""
    out = CACHE / "tmp" / f"r3-config-dense-{os.getpid()}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        for src in tiny_moe.iterdir():
            if src.name.endswith(".json") and src.name != "build_params.json":
                shutil.copy(src, out / src.name)
        config = json.loads((out / "config.json").read_text())
        for key in (
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "decoder_sparse_step",
            "mlp_only_layers",
            "norm_topk_prob",
            "output_router_logits",
            "router_aux_loss_coef",
        ):
            config.pop(key)
        config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
        (out / "config.json").write_text(json.dumps(config, indent=2))
        yield out
    finally:
        shutil.rmtree(out, ignore_errors=True)


# --------------------------------------------------------------------------
# 1. Every spelling of the switch ends in ArtifactConfig
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        ["--enable-routed-experts"],
        ["--enable-return-routed-experts"],
        ["--artifact-config", '{"enable_routed_experts": true}'],
        ["--aux-output-config", '{"enable_return_routed_experts": true}'],
    ],
    ids=["flag", "alias", "artifact-config", "aux-output-config"],
)
def test_cli_spellings_enable_r3_and_leave_aux_output_off(parser, tiny_moe, flags):
    cfg = _from_cli(parser, tiny_moe, *flags)
    assert cfg.artifact_config.enable_routed_experts is True
    assert cfg.aux_output_config.enabled is False


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enable_routed_experts": True},
        {"enable_return_routed_experts": True},
        {"artifact_config": {"enable_routed_experts": True}},
        {"aux_output_config": {"enable_return_routed_experts": True}},
    ],
    ids=["enable_routed_experts", "enable_return_routed_experts", "artifact", "aux"],
)
def test_engine_args_keywords_enable_r3_and_leave_aux_output_off(tiny_moe, kwargs):
    cfg = _build(tiny_moe, **kwargs)
    assert cfg.artifact_config.enable_routed_experts is True
    assert cfg.aux_output_config.enabled is False


def test_llm_keyword_reaches_artifact_config(tiny_moe, monkeypatch):
    """LLM(enable_return_routed_experts=True) builds EngineArgs from its
    keywords; the engine itself is stubbed out before anything starts."""
    import vllm.entrypoints.llm as llm_module

    class Stop(Exception):
        pass

    captured: list[EngineArgs] = []

    def from_engine_args(engine_args, **_):
        captured.append(engine_args)
        raise Stop

    monkeypatch.setattr(llm_module.LLMEngine, "from_engine_args", from_engine_args)
    with pytest.raises(Stop):
        llm_module.LLM(
            model=str(tiny_moe), enable_return_routed_experts=True, **BASE_KWARGS
        )
    (engine_args,) = captured
    cfg = engine_args.create_engine_config()
    assert cfg.artifact_config.enable_routed_experts is True
    assert cfg.aux_output_config.enabled is False


def test_artifact_config_json_sets_capacity(parser, tiny_moe):
    cfg = _from_cli(
        parser,
        tiny_moe,
        "--artifact-config",
        '{"enable_routed_experts": true, "capacity_bytes": 300000}',
    )
    assert cfg.artifact_config.enable_routed_experts is True
    assert cfg.artifact_config.capacity_bytes == 300000


def test_aux_output_max_bytes_becomes_capacity_bytes(parser, tiny_moe):
    cfg = _from_cli(
        parser,
        tiny_moe,
        "--aux-output-config",
        '{"enable_return_routed_experts": true, "max_bytes": 200000}',
    )
    assert cfg.artifact_config.enable_routed_experts is True
    assert cfg.artifact_config.capacity_bytes == 200000
    assert cfg.aux_output_config.enabled is False
    assert cfg.aux_output_config.max_bytes is None


def test_aux_output_max_bytes_does_not_override_an_explicit_capacity(tiny_moe):
    cfg = _build(
        tiny_moe,
        artifact_config={"capacity_bytes": 300000},
        aux_output_config={"enable_return_routed_experts": True, "max_bytes": 200000},
    )
    assert cfg.artifact_config.enable_routed_experts is True
    assert cfg.artifact_config.capacity_bytes == 300000


def test_two_parses_get_different_instance_ids_and_namespaces(parser, tiny_moe):
    a = _from_cli(parser, tiny_moe, "--enable-routed-experts").artifact_config
    b = _from_cli(parser, tiny_moe, "--enable-routed-experts").artifact_config
    assert a.instance_id != b.instance_id
    assert a.namespace(0) != b.namespace(0)
    # A namespace is a function of the instance and the data-parallel rank.
    assert a.namespace(0) == a.namespace(0)
    assert a.namespace(0) != a.namespace(1)


def test_without_flags_r3_is_off(parser, tiny_moe):
    # Parse with the flag first: the parser's shared default ArtifactConfig
    # must not keep the switch for the next parse.
    first = _from_cli(parser, tiny_moe, "--enable-routed-experts")
    assert first.artifact_config.enable_routed_experts is True
    cfg = _from_cli(parser, tiny_moe)
    assert cfg.artifact_config.enable_routed_experts is False
    assert cfg.aux_output_config.enabled is False
    assert cfg.artifact_config.capacity_bytes is None  # derived only with R3 on
    assert _build(tiny_moe).artifact_config.enable_routed_experts is False


# --------------------------------------------------------------------------
# 2. compute_hash: the switch only
# --------------------------------------------------------------------------


def test_hash_changes_with_r3_switch(tiny_moe):
    on, off = _build_r3(tiny_moe), _build(tiny_moe)
    assert on.compute_hash() != off.compute_hash()
    # The same object with only the switch flipped: the field is a factor.
    before = on.compute_hash()
    on.artifact_config.enable_routed_experts = False
    assert on.compute_hash() != before
    assert on.compute_hash() == off.compute_hash()


def test_hash_ignores_capacity_shm_root_ttl_and_instance_id(tiny_moe):
    ref = _build_r3(tiny_moe)
    other = _build_r3(
        tiny_moe,
        artifact_config={
            "capacity_bytes": 1 << 20,
            "shm_root": _shm_name("hash"),
            "inactive_ttl_s": 120.0,
        },
    )
    assert other.artifact_config.capacity_bytes == 1 << 20
    assert other.artifact_config.shm_root == _shm_name("hash")
    assert other.artifact_config.instance_id != ref.artifact_config.instance_id
    assert other.compute_hash() == ref.compute_hash()
    other.artifact_config.instance_id = "0" * 32
    assert other.compute_hash() == ref.compute_hash()
    assert os.listdir(_shm_name("hash")) == []  # building creates no store
    os.rmdir(_shm_name("hash"))


def test_compile_factors_are_the_switch_only():
    """vLLM 0.34 keys its compile cache on compile_factors(); 0.32 on
    compute_hash(), which hashes the same factors."""
    from vllm.config.utils import hash_factors

    on = ArtifactConfig(enable_routed_experts=True, capacity_bytes=1 << 20)
    assert on.compile_factors() == {"enable_routed_experts": True}
    assert ArtifactConfig().compile_factors() == {"enable_routed_experts": False}
    assert on.compute_hash() == hash_factors(on.compile_factors())


# --------------------------------------------------------------------------
# 3. verify_artifact_config: every rejection names its fix
# --------------------------------------------------------------------------


@pytest.fixture
def v1_model_runner(monkeypatch):
    """VLLM_USE_V2_MODEL_RUNNER=0 (harness_env sets it to 1), read afresh
    even if an in-process engine turned on vllm.envs' cache."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    if envs._is_envs_cache_enabled():
        monkeypatch.setattr(envs, "__getattr__", envs.__getattr__.__wrapped__)
    assert envs.VLLM_USE_V2_MODEL_RUNNER is False


def test_rejects_v1_model_runner(tiny_moe, v1_model_runner):
    with _rejects(FIX_V2):
        _build_r3(tiny_moe)
    assert _build(tiny_moe).use_v2_model_runner is False  # off: accepted


def test_rejects_standalone_cpu_model_runner(tiny_moe, monkeypatch):
    """vLLM 0.34 runs a standalone CPU model runner (no Triton, non-x86) that
    has none of Model Runner V2's capture hooks: refused. 0.32's platforms
    have no such runner (the method is absent), so it is added here."""
    from vllm.platforms import current_platform

    cfg = _build_r3(tiny_moe)
    platform_cls = type(current_platform)
    monkeypatch.setattr(
        platform_cls,
        "uses_standalone_cpu_model_runner",
        classmethod(lambda cls: True),
        raising=False,
    )
    with _rejects("serve routed experts on a GPU, or on an x86 CPU"):
        verify_artifact_config(cfg)
    monkeypatch.setattr(
        platform_cls, "uses_standalone_cpu_model_runner", classmethod(lambda cls: False)
    )
    verify_artifact_config(cfg)  # Model Runner V2: accepted


def test_rejects_pooling_runner(tiny_moe):
    with _rejects(FIX_RUNNER):
        _build_r3(tiny_moe, runner="pooling")


def test_rejects_model_without_moe_layers(tiny_dense):
    off = _build(tiny_dense)
    assert off.model_config.is_moe is False  # the rejection's premise
    with _rejects(FIX_MOE):
        _build_r3(tiny_dense)


def test_rejects_prefix_caching_off(tiny_moe):
    with _rejects(FIX_PREFIX):
        _build_r3(tiny_moe, enable_prefix_caching=False)


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        ({"pipeline_parallel_size": 2}, FIX_PP),
        # DCP needs tp divisible by dcp and tp above the model's 2 KV heads,
        # else ParallelConfig/VllmConfig reject it before the verifier.
        ({"tensor_parallel_size": 4, "decode_context_parallel_size": 2}, FIX_CP),
        ({"prefill_context_parallel_size": 2}, FIX_CP),
        # Micro-batching asserts a DeepEP/NIXL-EP all2all backend first.
        ({"ubatch_size": 2, "all2all_backend": "deepep_low_latency"}, FIX_DBO),
        ({"distributed_executor_backend": "external_launcher"}, FIX_EXECUTOR),
    ],
    ids=["pp", "dcp", "pcp", "ubatch", "external-launcher"],
)
def test_rejects_parallelism(tiny_moe, kwargs, fix):
    with _rejects(fix):
        _build_r3(tiny_moe, **kwargs)


def test_rejects_dual_batch_overlap(tiny_moe):
    # The CPU platform resets --enable-dbo to False while the config is
    # built, so enable_dbo=True never reaches the verifier here: set it on a
    # built config and verify that directly.
    cfg = _build_r3(tiny_moe)
    cfg.parallel_config.enable_dbo = True
    assert cfg.parallel_config.use_ubatching
    with _rejects(FIX_DBO):
        verify_artifact_config(cfg)


@pytest.mark.parametrize(
    "kv_transfer_config",
    [
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_producer"},
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_consumer"},
        {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "connectors": [
                    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
                    {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                ]
            },
        },
    ],
    ids=["producer", "consumer", "nixl", "multi-with-nixl"],
)
def test_rejects_kv_transfer(tiny_moe, kv_transfer_config):
    with _rejects(FIX_KV) as exc:
        _build_r3(tiny_moe, kv_transfer_config=kv_transfer_config)
    role = kv_transfer_config["kv_role"]
    assert f"kv_role={role}" in str(exc.value)


@pytest.mark.parametrize(
    "kv_transfer_config",
    [
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "connectors": [
                    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
                ]
            },
        },
    ],
    ids=["offloading", "multi-offloading"],
)
def test_accepts_local_kv_offload(tiny_moe, kv_transfer_config):
    cfg = _build_r3(tiny_moe, kv_transfer_config=kv_transfer_config)
    assert cfg.artifact_config.enable_routed_experts is True
    assert cfg.kv_transfer_config.kv_connector == kv_transfer_config["kv_connector"]
    # Its hits are this engine's own KV: taken whole, never cut.
    assert not loads_shared_kv(cfg.kv_transfer_config)


def test_rejects_adaptive_speculative_verification(tiny_moe):
    # Adaptive verification needs full CUDA graphs, which the CPU platform
    # turns off, so VllmConfig rejects it before the verifier: build an ngram
    # speculative config that passes, then switch adaptive verification on.
    cfg = _build_r3(
        tiny_moe,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_max": 3,
        },
    )
    verify_artifact_config(cfg)  # accepted without it
    cfg.speculative_config.enable_adaptive_verification = True
    with _rejects(FIX_ADAPTIVE):
        verify_artifact_config(cfg)


@pytest.mark.parametrize(
    "shm_root",
    ["/tmp/x", "/dev/shm", "/dev/shm/../tmp/x", "dev/shm/x"],
    ids=["tmp", "shm-base", "dotdot", "relative"],
)
def test_rejects_shm_root_outside_dev_shm(tiny_moe, shm_root):
    with pytest.raises(ValueError, match="artifact shm_root"):
        _build_r3(tiny_moe, artifact_config={"shm_root": shm_root})


def test_shm_root_tmp_names_the_fix(tiny_moe):
    with _rejects(FIX_SHM_ROOT):
        _build_r3(tiny_moe, artifact_config={"shm_root": "/tmp/x"})


@pytest.mark.parametrize("target", ["outside", "inside"])
def test_rejects_shm_root_through_symlink(tiny_moe, target):
    """A link under /dev/shm to a directory outside it, or to another one
    inside it: the store must be reached without symlinks either way."""
    link = _shm_name("link")
    if target == "outside":
        dest = str(CACHE / "tmp" / f"r3-config-link-target-{os.getpid()}")
    else:
        dest = _shm_name("target")
    os.makedirs(dest, mode=0o700)
    try:
        os.symlink(dest, link)
        with _rejects(FIX_SHM_ROOT):
            _build_r3(tiny_moe, artifact_config={"shm_root": f"{link}/store"})
        with _rejects(FIX_SHM_ROOT):
            _build_r3(tiny_moe, artifact_config={"shm_root": link})
    finally:
        if os.path.lexists(link):
            os.unlink(link)
        shutil.rmtree(dest, ignore_errors=True)


def test_accepts_shm_root_under_dev_shm_creating_only_the_root(tiny_moe):
    root = _shm_name("ok")
    try:
        cfg = _build_r3(tiny_moe, artifact_config={"shm_root": root})
        assert cfg.artifact_config.shm_root == root
        assert os.listdir(root) == []  # the root (r5 M4), no store in it
    finally:
        _remove(root)


@pytest.mark.parametrize(
    "choice, dtype",
    [("auto", np.uint8), ("uint16", np.uint16), ("int32", np.int32)],
)
def test_routed_experts_dtype_gives_row_spec(tiny_moe, choice, dtype):
    cfg = _build_r3(tiny_moe, artifact_config={"routed_experts_dtype": choice})
    assert cfg.model_config.get_num_experts() == 8
    spec = routed_experts_row_spec(cfg)
    assert spec.dtype == np.dtype(dtype)
    assert spec.row_shape == (2, 2)  # [num_hidden_layers, top_k]


def test_aux_output_config_set_directly_on_vllm_config_is_rejected(tiny_moe):
    model_config = _build(tiny_moe).model_config
    with _rejects(FIX_AUX):
        VllmConfig(
            model_config=model_config,
            aux_output_config=AuxOutputConfig(enable_return_routed_experts=True),
        )
    # The check does not depend on the R3 switch.
    with _rejects(FIX_AUX):
        VllmConfig(
            model_config=model_config,
            artifact_config=ArtifactConfig(enable_routed_experts=True),
            aux_output_config=AuxOutputConfig(enable_return_routed_experts=True),
        )


# --------------------------------------------------------------------------
# 4. Startup gaps: causes found after or around the verifier
# --------------------------------------------------------------------------


def test_prefix_caching_turned_off_after_verification_is_rejected(tiny_moe):
    """The engine core turns prefix caching off for models with non-causal
    attention layers after the verifier ran; the scheduler connector calls
    check_prefix_caching_for_routed_experts then."""
    cfg = _build_r3(tiny_moe)
    check_prefix_caching_for_routed_experts(cfg)  # on: accepted
    cfg.cache_config.enable_prefix_caching = False
    with _rejects("non-causal attention layers") as exc:
        check_prefix_caching_for_routed_experts(cfg)
    assert "serve this model without --enable-routed-experts" in str(exc.value)
    assert FIX_PREFIX not in str(exc.value)
    cfg.artifact_config.enable_routed_experts = False
    check_prefix_caching_for_routed_experts(cfg)  # R3 off: nothing to check


def _patch_property(monkeypatch, cls, name, value):
    monkeypatch.setattr(cls, name, property(lambda self: value))


@pytest.mark.parametrize(
    "cause, expected",
    [
        ("model-unsupported", "does not support (encoder_decoder attention)"),
        ("model-hook", "which UnlimitedOCRForCausalLM turns off"),
        ("encoder-only", "enable routed experts on the instances that generate"),
        ("riscv", "which vLLM turns off on RISC-V CPUs"),
        ("cpu-mla", "which the CPU platform turns off for MLA models"),
    ],
)
def test_prefix_caching_off_names_its_real_cause(
    tiny_moe, monkeypatch, cause, expected
):
    """Prefix caching turned off by the model or the platform before the
    verifier: the message names that, not --no-enable-prefix-caching. The
    causes are simulated on a built configuration (the tiny MoE has none)."""
    from vllm.platforms import CpuArchEnum, current_platform

    cfg = _build_r3(tiny_moe)
    cfg.cache_config.enable_prefix_caching = False
    if cause == "model-unsupported":
        _patch_property(monkeypatch, ModelConfig, "is_prefix_caching_supported", False)
        _patch_property(monkeypatch, ModelConfig, "attn_type", "encoder_decoder")
        expected = f"which {tiny_moe} {expected}"
    elif cause == "model-hook":
        _patch_property(
            monkeypatch, ModelConfig, "architectures", ["UnlimitedOCRForCausalLM"]
        )
    elif cause == "encoder-only":
        _patch_property(monkeypatch, VllmConfig, "is_mm_encoder_only", True)
    elif cause == "riscv":
        monkeypatch.setattr(
            current_platform, "get_cpu_architecture", lambda: CpuArchEnum.RISCV
        )
    else:
        _patch_property(monkeypatch, ModelConfig, "use_mla", True)
    with _rejects(expected) as exc:
        verify_artifact_config(cfg)
    assert FIX_PREFIX not in str(exc.value)


@pytest.fixture
def v2_model_runner_unset(monkeypatch):
    """VLLM_USE_V2_MODEL_RUNNER unset: vLLM picks the runner itself."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    if envs._is_envs_cache_enabled():
        monkeypatch.setattr(envs, "__getattr__", envs.__getattr__.__wrapped__)
    assert envs.VLLM_USE_V2_MODEL_RUNNER is None


@pytest.mark.parametrize(
    "cause, expected",
    [
        ("no-triton", "install Triton"),
        ("unsupported", "drop speculative method 'suffix'"),
    ],
)
def test_model_runner_v1_fallback_names_its_real_cause(
    tiny_moe, monkeypatch, cause, expected
):
    """With VLLM_USE_V2_MODEL_RUNNER unset, vLLM falls back to V1 without
    Triton or for features V2 lacks; setting the variable is not the fix.
    Built with V2 first, then the fallback is simulated (this CPU harness
    forces V2)."""
    import vllm.config.vllm as vllm_module

    cfg = _build_r3(tiny_moe)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    if envs._is_envs_cache_enabled():
        monkeypatch.setattr(envs, "__getattr__", envs.__getattr__.__wrapped__)
    assert envs.VLLM_USE_V2_MODEL_RUNNER is None
    monkeypatch.setattr(vllm_module, "HAS_TRITON", cause != "no-triton")
    features = ["speculative method 'suffix'"] if cause == "unsupported" else []
    monkeypatch.setattr(
        VllmConfig, "_get_v2_model_runner_unsupported_features", lambda self: features
    )
    assert cfg.use_v2_model_runner is False
    with _rejects(expected) as exc:
        verify_artifact_config(cfg)
    if cause == "unsupported":  # forcing V2 is no fix for what V2 lacks
        assert FIX_V2 not in str(exc.value)


def test_rejects_capacity_below_the_store_minimum(tiny_moe):
    with _rejects(f'{{"capacity_bytes": {MIN_CAPACITY_BYTES}}}'):
        _build_r3(tiny_moe, artifact_config={"capacity_bytes": MIN_CAPACITY_BYTES - 1})
    cfg = _build_r3(tiny_moe, artifact_config={"capacity_bytes": MIN_CAPACITY_BYTES})
    assert cfg.artifact_config.capacity_bytes == MIN_CAPACITY_BYTES


def test_sizes_derived_from_the_node_for_the_engines_that_share_it(
    tiny_moe, monkeypatch
):
    """Unset sizes come from /dev/shm (a 24 MiB tmpfs here) divided by the
    engines that share it: half of it for all of them, 2/3 of each share
    for the store, 1/3 for references; explicit values are kept."""
    from utils.shm import small_tmpfs

    monkeypatch.delenv("VLLM_ENGINES_PER_NODE", raising=False)
    share = (24 << 20) // 2 // 4
    with small_tmpfs("24m") as mnt:
        root = os.path.join(mnt, "store")
        four = {"shm_root": root, "engines_per_node": 4}
        cfg = _build_r3(tiny_moe, artifact_config=four).artifact_config
        assert cfg.capacity_bytes == share * 2 // 3
        assert cfg.ref_max_bytes == share // 3
        monkeypatch.setenv("VLLM_ENGINES_PER_NODE", "4")
        env = _build_r3(tiny_moe, artifact_config={"shm_root": root})
        assert env.artifact_config.capacity_bytes == share * 2 // 3
        explicit = {**four, "capacity_bytes": 1 << 20, "ref_max_bytes": 12345}
        cfg = _build_r3(tiny_moe, artifact_config=explicit).artifact_config
        assert (cfg.capacity_bytes, cfg.ref_max_bytes) == (1 << 20, 12345)
        with _rejects("$VLLM_ENGINES_PER_NODE must be a positive integer"):
            monkeypatch.setenv("VLLM_ENGINES_PER_NODE", "eight")
            _build_r3(tiny_moe, artifact_config={"shm_root": root})
        monkeypatch.delenv("VLLM_ENGINES_PER_NODE")
        # 24 MiB shared by 100 engines leaves each less than the smallest store.
        with _rejects(f'{{"capacity_bytes": {MIN_CAPACITY_BYTES}}}') as e:
            _build_r3(tiny_moe, artifact_config={**four, "engines_per_node": 100})
        assert "--shm-size" in str(e.value)
    # On a large /dev/shm the defaults stay at their caps.
    big = _build_r3(tiny_moe, artifact_config={"engines_per_node": 1})
    total = os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize
    assert big.artifact_config.capacity_bytes == min(8 << 30, total // 2 * 2 // 3)


def test_an_explicit_capacity_is_kept_however_small_the_share(tiny_moe, monkeypatch):
    """r5 L8: with capacity_bytes set, a share of /dev/shm below the smallest
    store refuses nothing (the user chose the capacity); ref_max_bytes, left
    unset, is still derived from the share (1 MiB at least)."""
    from utils.shm import small_tmpfs

    monkeypatch.delenv("VLLM_ENGINES_PER_NODE", raising=False)
    with small_tmpfs("24m") as mnt:
        crowded = {"shm_root": os.path.join(mnt, "store"), "engines_per_node": 100}
        explicit = {**crowded, "capacity_bytes": 2 << 20}
        cfg = _build_r3(tiny_moe, artifact_config=explicit).artifact_config
        assert (cfg.capacity_bytes, cfg.ref_max_bytes) == (2 << 20, 1 << 20)
        with _rejects(f'{{"capacity_bytes": {MIN_CAPACITY_BYTES}}}'):
            _build_r3(tiny_moe, artifact_config=crowded)  # derived: refused


@pytest.mark.parametrize("ttl", [0.0, MIN_INACTIVE_TTL_S - 1])
def test_rejects_inactive_ttl_below_the_minimum(tiny_moe, ttl):
    with _rejects(f'{{"inactive_ttl_s": {MIN_INACTIVE_TTL_S:g}}}'):
        _build_r3(tiny_moe, artifact_config={"inactive_ttl_s": ttl})
    cfg = _build_r3(tiny_moe, artifact_config={"inactive_ttl_s": MIN_INACTIVE_TTL_S})
    assert cfg.artifact_config.inactive_ttl_s == MIN_INACTIVE_TTL_S


@pytest.mark.parametrize(
    "choice, num_experts", [("auto", (1 << 15) + 1), ("uint16", (1 << 16) + 1)]
)
def test_too_many_experts_for_the_dtype_names_int32(
    tiny_moe, monkeypatch, choice, num_experts
):
    cfg = _build_r3(tiny_moe, artifact_config={"routed_experts_dtype": choice})
    monkeypatch.setattr(ModelConfig, "get_num_experts", lambda self: num_experts)
    with _rejects("""set --artifact-config '{"routed_experts_dtype": "int32"}'"""):
        verify_artifact_config(cfg)
    cfg.artifact_config.routed_experts_dtype = "int32"
    assert routed_experts_row_spec(cfg).dtype == np.int32


def test_rejects_moe_on_a_subset_of_tokens(tiny_moe, monkeypatch):
    """ERNIE-4.5-VL-MoE runs text and vision tokens through two expert sets
    with one layer id: the base's capturer would misalign their rows."""
    cfg = _build_r3(tiny_moe)
    arch = "Ernie4_5_VLMoeForConditionalGeneration"
    _patch_property(monkeypatch, ModelConfig, "architectures", [arch])
    with _rejects(arch) as exc:
        verify_artifact_config(cfg)
    assert FIX_MOE in str(exc.value)


# A store root another local user (or a stray file) took first.
HIJACKS = ["other-owner", "mode-755", "symlink", "file"]


def _hijack(path: str, how: str, target: str) -> None:
    if how == "other-owner":
        os.mkdir(path, 0o700)
        os.chown(path, 65534, 65534)  # nobody; these tests run as root
    elif how == "mode-755":
        os.mkdir(path)
        os.chmod(path, 0o755)
    elif how == "symlink":
        os.makedirs(target, mode=0o700)
        os.symlink(target, path)
    else:
        with open(path, "w"):
            pass


def _remove(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.lexists(path):
        shutil.rmtree(path)


@pytest.fixture
def hijack_paths():
    paths = [_shm_name("hijacked"), _shm_name("hijack-target")]
    yield paths
    for p in paths:
        _remove(p)
    for name in os.listdir("/dev/shm"):
        if name.startswith(os.path.basename(paths[0]) + "-"):
            _remove(os.path.join("/dev/shm", name))


@pytest.mark.parametrize("how", HIJACKS)
def test_hijacked_default_shm_root_gets_a_fresh_private_root(
    tiny_moe, monkeypatch, hijack_paths, how
):
    from vllm.distributed.artifact_connector.shm import ShmStoreWriter, make_namespace

    default, target = hijack_paths
    monkeypatch.setattr(settings_module, "default_shm_root", lambda: default)
    _hijack(default, how, target)
    warnings: list[str] = []
    monkeypatch.setattr(
        node_module.logger, "warning", lambda msg, *a: warnings.append(msg % a)
    )
    cfg = _build_r3(tiny_moe)  # no shm_root given: the default
    root = cfg.artifact_config.shm_root
    assert re.fullmatch(re.escape(default) + "-[0-9a-f]{16}", root), root
    st = os.lstat(root)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) == 0o700
    (warning,) = warnings
    assert default in warning and root in warning
    if how == "other-owner":
        assert "uid 65534" in warning
    # The engine processes get the fresh root with the pickled config, and
    # it goes at shutdown like the default one: the writer removes it.
    verify_artifact_config(cfg)  # verified again (a copy): the same root
    assert cfg.artifact_config.shm_root == root
    writer = ShmStoreWriter(root, make_namespace(), capacity_bytes=MIN_CAPACITY_BYTES)
    writer.close()
    assert not os.path.lexists(root)


def test_fresh_roots_of_crashed_engines_are_collected(
    tiny_moe, monkeypatch, hijack_paths
):
    """A crashed engine's store in an earlier fresh root is collected when
    the next engine picks its own fresh root (nobody uses the old one)."""
    from tests.artifact_connector.helpers import make_dead
    from vllm.distributed.artifact_connector.shm import ShmStoreWriter, make_namespace

    default, target = hijack_paths
    monkeypatch.setattr(settings_module, "default_shm_root", lambda: default)
    _hijack(default, "other-owner", target)
    earlier = _build_r3(tiny_moe).artifact_config.shm_root
    ns = make_namespace()
    dead = ShmStoreWriter(earlier, ns, capacity_bytes=MIN_CAPACITY_BYTES)
    alive_ns = make_namespace()
    alive = ShmStoreWriter(earlier, alive_ns, capacity_bytes=MIN_CAPACITY_BYTES)
    try:
        make_dead(os.path.join(earlier, ns))
        later = _build_r3(tiny_moe).artifact_config.shm_root
        assert later != earlier
        assert not os.path.lexists(os.path.join(earlier, ns))
        assert os.path.isdir(os.path.join(earlier, alive_ns))  # live: kept
    finally:
        dead.close()
        alive.close()


def test_default_shm_root_is_taken_when_the_config_resolves_it(
    tiny_moe, monkeypatch, hijack_paths
):
    """r5 M4: the default root is created (ours, 0700) while the config is
    built, so another local user who tries to create it before the worker
    starts its store (after model load, often tens of seconds later) finds
    it taken, and the worker's store starts in it."""
    from vllm.distributed.artifact_connector.shm import ShmStoreWriter, make_namespace

    default, _ = hijack_paths
    monkeypatch.setattr(settings_module, "default_shm_root", lambda: default)
    root = _build_r3(tiny_moe).artifact_config.shm_root
    assert root == default
    st = os.lstat(root)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) == 0o700
    # Another local user, between the config and the worker (as root here:
    # the chown stands in for the other user's mkdir).
    try:
        os.mkdir(default, 0o777)
        os.chown(default, 65534, 65534)
    except FileExistsError:
        pass
    writer = ShmStoreWriter(root, make_namespace(), capacity_bytes=MIN_CAPACITY_BYTES)
    writer.close()


def test_explicit_missing_shm_root_is_created_private(tiny_moe, hijack_paths):
    """A missing explicit root is created 0700 with the config, each missing
    component of it too."""
    parent, _ = hijack_paths
    root = f"{parent}/store"
    cfg = _build_r3(tiny_moe, artifact_config={"shm_root": root})
    assert cfg.artifact_config.shm_root == root
    for path in (parent, root):
        st = os.lstat(path)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
        assert stat.S_IMODE(st.st_mode) == 0o700


@pytest.mark.parametrize("how", HIJACKS)
@pytest.mark.parametrize("nested", [False, True], ids=["root", "parent"])
def test_explicit_shm_root_failing_its_checks_is_refused(
    tiny_moe, hijack_paths, how, nested
):
    bad, target = hijack_paths
    _hijack(bad, how, target)
    root = f"{bad}/store" if nested else bad
    with pytest.raises(ValueError, match="artifact shm_root") as exc:
        _build_r3(tiny_moe, artifact_config={"shm_root": root})
    if how != "symlink":  # a symlink is refused by the path check first
        assert "--artifact-config" in str(exc.value)
    assert not [
        n for n in os.listdir("/dev/shm") if n.startswith(os.path.basename(bad) + "-")
    ]


def test_explicit_private_shm_root_is_accepted(tiny_moe):
    root = _shm_name("private")
    os.mkdir(root, 0o700)
    try:
        cfg = _build_r3(tiny_moe, artifact_config={"shm_root": root})
        assert cfg.artifact_config.shm_root == root
    finally:
        os.rmdir(root)


@pytest.mark.parametrize("master", [None, "no-port", "10.0.0.5:port"])
@pytest.mark.parametrize("field", ["ref_transport", "backend"])
def test_rejects_mooncake_without_a_master_address(tiny_moe, master, field):
    cfg: dict = {field: "mooncake", "key_space": "k"}
    if master is not None:
        cfg["mooncake_master"] = master
    with _rejects('"mooncake_master": "10.0.0.5:50051"') as exc:
        _build_r3(tiny_moe, artifact_config=cfg)
    assert f"with {field} mooncake" in str(exc.value)


def _shared_storage(role: str = "kv_both") -> dict:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": "/nonexistent"},
    }


def _multi(*connectors: dict) -> dict:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": list(connectors)},
    }


def test_rejects_a_multi_connector_of_shared_kv_and_cpu_offload(
    tiny_moe, monkeypatch, shared_secret
):
    """ExampleConnector beside CPU offload in one MultiConnector: the hit
    cut meant for shared KV would apply to offload hits too. Refused."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    artifact = {"backend": "mooncake", "key_space": "k", "mooncake_master": "h:1"}
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    with _rejects("use ExampleConnector alone (with backend mooncake), or CPU") as e:
        _build_r3(
            tiny_moe,
            kv_transfer_config=_multi(offload, _shared_storage()),
            artifact_config=artifact,
        )
    assert "MultiConnector of OffloadingConnector, ExampleConnector" in str(e.value)


def test_checks_each_connectors_role_in_a_multi_connector(
    tiny_moe, monkeypatch, shared_secret
):
    """A CPU-offload connector inside a MultiConnector needs kv_both like one
    alone, whatever the other connectors' roles."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    artifact = {"backend": "mooncake", "key_space": "k", "mooncake_master": "h:1"}
    producer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_producer"}
    with _rejects(FIX_KV) as e:
        _build_r3(
            tiny_moe,
            kv_transfer_config=_multi(producer, _shared_storage()),
            artifact_config=artifact,
        )
    assert "kv_producer" in str(e.value)


def test_rejects_shared_kv_without_the_shared_store(tiny_moe):
    with _rejects(FIX_SHARED_KV) as exc:
        _build_r3(tiny_moe, kv_transfer_config=_shared_storage())
    assert "ExampleConnector loads KV other engines computed" in str(exc.value)


@pytest.fixture
def shared_secret(monkeypatch):
    """The deployment secret ``backend: mooncake`` needs, in its variable."""
    monkeypatch.setenv(SHARED_SECRET_ENV, "a secret of the config tests")


@pytest.mark.parametrize("role", ["kv_both", "kv_producer", "kv_consumer"])
def test_accepts_shared_kv_with_the_shared_store(
    tiny_moe, role, monkeypatch, shared_secret
):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    artifact = {"backend": "mooncake", "key_space": "k", "mooncake_master": "h:1"}
    cfg = _build_r3(
        tiny_moe, kv_transfer_config=_shared_storage(role), artifact_config=artifact
    )
    assert cfg.artifact_config.key_namespace(0) == "key-space:k"
    assert cfg.artifact_config.key_namespace(1) == "key-space:k"
    assert loads_shared_kv(cfg.kv_transfer_config)  # its hits are cut


def test_serve_flags_take_the_shared_store_and_shared_kv(
    parser, tiny_moe, shared_secret
):
    """What a `vllm serve` of a prefill/decode pair passes, parsed as the CLI
    parses it."""
    cfg = _from_cli(
        parser,
        tiny_moe,
        "--enable-routed-experts",
        "--kv-transfer-config",
        json.dumps(_shared_storage("kv_consumer")),
        "--artifact-config",
        '{"backend": "mooncake", "key_space": "rollout-7", '
        '"mooncake_master": "10.0.0.5:50051", "mooncake_local_hostname": "10.0.0.11"}',
    )
    a = cfg.artifact_config
    assert (a.backend, a.key_space, a.mooncake_master) == (
        "mooncake",
        "rollout-7",
        "10.0.0.5:50051",
    )
    assert a.mooncake_local_hostname == "10.0.0.11"
    assert cfg.kv_transfer_config.kv_role == "kv_consumer"


def test_rejects_the_shared_store_without_a_key_space(tiny_moe):
    with _rejects('"key_space": "my-deployment"'):
        _build_r3(
            tiny_moe, artifact_config={"backend": "mooncake", "mooncake_master": "h:1"}
        )


def test_rejects_a_shared_key_space_with_random_block_hashes(
    tiny_moe, monkeypatch, shared_secret
):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    artifact = {"backend": "mooncake", "key_space": "k", "mooncake_master": "h:1"}
    with _rejects("set PYTHONHASHSEED to the same value on every engine"):
        _build_r3(tiny_moe, prefix_caching_hash_algo="xxhash", artifact_config=artifact)
    # sha256's seed is fixed unless PYTHONHASHSEED sets it: accepted.
    _build_r3(tiny_moe, prefix_caching_hash_algo="sha256", artifact_config=artifact)


SECRET_FIX = """set --artifact-config '{"shared_secret_file": "/path/to/secret", """


def _secret_file(tmp_path, content: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(content)
    path.chmod(mode)
    return path


def _shared(**extra) -> dict:
    return {"backend": "mooncake", "key_space": "k", "mooncake_master": "h:1", **extra}


def test_rejects_the_shared_store_without_a_secret(tiny_moe, monkeypatch):
    monkeypatch.delenv(SHARED_SECRET_ENV, raising=False)
    with _rejects(SECRET_FIX) as exc:
        _build_r3(tiny_moe, artifact_config=_shared())
    assert "needs a deployment secret to authenticate shared routes" in str(exc.value)


def test_takes_the_secret_from_a_private_file(tiny_moe, tmp_path, monkeypatch):
    monkeypatch.delenv(SHARED_SECRET_ENV, raising=False)
    path = _secret_file(tmp_path, b"0123456789abcdef0123\n")
    cfg = _build_r3(tiny_moe, artifact_config=_shared(shared_secret_file=str(path)))
    # The trailing newline is not part of the secret.
    assert read_shared_secret(cfg.artifact_config) == b"0123456789abcdef0123"


@pytest.mark.parametrize(
    "case, fix",
    [
        ("open to others", "chmod 600 it"),
        ("a symlink", "a symlink is refused"),
        ("missing", "No such file or directory"),
        ("too short", "must hold 16 to 4096 bytes, got 5"),
    ],
)
def test_rejects_an_unsafe_or_short_secret_file(tiny_moe, tmp_path, case, fix):
    path = _secret_file(
        tmp_path, b"short" if case == "too short" else b"s" * 32,
        0o644 if case == "open to others" else 0o600,
    )  # fmt: skip
    if case == "a symlink":
        link = tmp_path / "link"
        link.symlink_to(path)
        path = link
    elif case == "missing":
        path = tmp_path / "nowhere"
    with _rejects(fix):
        _build_r3(tiny_moe, artifact_config=_shared(shared_secret_file=str(path)))


@pytest.mark.parametrize(
    "content, secret",
    [
        (b"\n\t " + bytes(range(200, 213)), b"\n\t " + bytes(range(200, 213))),
        (bytes(range(200, 214)) + b"\t ", bytes(range(200, 214)) + b"\t "),
        (bytes(range(200, 215)) + b" \n", bytes(range(200, 215)) + b" "),
        (b"\r\n" + bytes(range(200, 214)), b"\r\n" + bytes(range(200, 214))),
        (b"0123456789abcdef\r\n", b"0123456789abcdef"),
        (b"0123456789abcdef\n\n", b"0123456789abcdef\n"),
        (b"\x0b" * 16, b"\x0b" * 16),
    ],
    ids=["leading", "trailing", "space-newline", "lead-crlf", "crlf", "2lf", "vt"],
)
def test_a_binary_secret_is_used_byte_for_byte(tmp_path, monkeypatch, content, secret):
    """r5 L6: the secret is bytes (``head -c 32 /dev/urandom`` or hex/base64
    text alike): only one trailing newline (``\\n`` or ``\\r\\n``) is
    not part of it; whitespace bytes anywhere else are kept."""
    monkeypatch.delenv(SHARED_SECRET_ENV, raising=False)
    path = _secret_file(tmp_path, content)
    cfg = ArtifactConfig(shared_secret_file=str(path))
    assert read_shared_secret(cfg) == secret


def test_rejects_an_unknown_routed_experts_format(tiny_moe):
    with pytest.raises(ValueError, match="routed_experts_format"):
        _build_r3(tiny_moe, artifact_config={"routed_experts_format": "npy"})


def test_the_config_is_a_leaf():
    """``import vllm.config`` loads no module of the store, the connector or
    the host transport (so it registers none of their at-fork hooks): the
    config layer imports nothing above it."""
    code = (
        "import sys, vllm.config\n"
        "print([m for m in sys.modules if m.startswith("
        "('vllm.distributed.artifact_connector', 'vllm_host_transport'))])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "[]", out


def _config_modules() -> dict[str, set[str]]:
    """Each fork module of the routed-experts configuration and the others
    of them it imports, anywhere in it (type-only and deferred imports
    included: a circle through them is a circle all the same)."""
    import ast

    folder = Path(__file__).resolve().parent.parent / "vllm" / "config"
    modules = {p.stem: p for p in folder.glob("artifact*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module]
                if node.module == "vllm.config":
                    targets = [f"vllm.config.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                stem = target.rpartition(".")[2]
                if target.startswith("vllm.config.") and stem in modules:
                    graph[name].add(stem)
    return graph


def test_the_config_modules_do_one_job_each_in_layers():
    """The configuration's modules import one another in one direction only
    (no circle: ``artifact.py`` and ``artifact_transfer.py`` imported each
    other), and none holds two jobs (past about 600 lines)."""
    graph = _config_modules()
    assert {"artifact", "artifact_transfer", "artifact_sizing"} <= graph.keys()

    def reaches(start: str, goal: str, seen: frozenset = frozenset()) -> bool:
        return any(
            nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt}))
            for nxt in graph[start]
        )

    circles = sorted(name for name in graph if reaches(name, name))
    assert circles == [], graph
    folder = Path(__file__).resolve().parent.parent / "vllm" / "config"
    lengths = {n: len((folder / f"{n}.py").read_text().splitlines()) for n in graph}
    assert max(lengths.values()) <= 600, lengths
