# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The routed-experts (R3) configuration as the engine takes it: the older
spellings of the switch translated into ``ArtifactConfig``, the returned
row's shape and dtype, and every configuration R3 cannot serve exactly
rejected at startup with the fix, before the node-dependent parts are
resolved (``artifact_node.py``). ``ArtifactConfig`` itself is defined in
``artifact_settings.py``; the patches import it from here."""

import dataclasses
import uuid
from typing import TYPE_CHECKING

import numpy as np

from vllm.config.artifact_node import resolve_shm_root, size_from_node
from vllm.config.artifact_settings import (
    MAX_REF_HANDOFF_TIMEOUT_S,
    ArtifactConfig,
)
from vllm.config.artifact_sizing import MIN_CAPACITY_BYTES, MIN_INACTIVE_TTL_S
from vllm.config.artifact_transfer import (
    check_key_space,
    check_kv_connectors,
    check_mooncake,
)
from vllm.logger import init_logger
from vllm.utils.routed_experts_rows import RowSpec

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

# The names other modules import from here: ArtifactConfig (the upstream
# patches: vllm/config/__init__.py, vllm.py), the limits (the frontend, tests).
__all__ = [
    "MAX_REF_HANDOFF_TIMEOUT_S",
    "MIN_CAPACITY_BYTES",
    "MIN_INACTIVE_TTL_S",
    "ArtifactConfig",
    "check_prefix_caching_for_routed_experts",
    "routed_experts_row_spec",
    "translate_routed_experts_args",
    "verify_artifact_config",
]

logger = init_logger(__name__)

# MoE architectures that run a FusedMoE on a subset of the batch's tokens:
# the base's capturer writes the subset's routes to the first rows of the
# step, so the rows of the other tokens are wrong.
SUBSET_MOE_ARCHITECTURES = {
    "Ernie4_5_VLMoeForConditionalGeneration": (
        "routes text and vision tokens through two expert sets under one layer id"
    ),
}

# Models whose own config hook turns prefix caching off (model_executor/
# models/config.py), with the reason the hook gives.
MODELS_WITHOUT_PREFIX_CACHING = {
    "UnlimitedOCRForCausalLM": "its R-SWA decode KV cannot be reused",
}


def translate_routed_experts_args(args: "EngineArgs") -> None:
    """The one place where the older spellings of the switch become
    ``ArtifactConfig``: ``enable_return_routed_experts`` (flag, ``LLM``
    keyword) and ``aux_output_config``, whose ``max_bytes`` becomes the
    store's capacity unless that is set. AuxOutput itself never runs."""
    from vllm.config.aux_output import AuxOutputConfig

    # A copy with its own store identity: the parser's default instance is
    # shared between parses.
    cfg = dataclasses.replace(args.artifact_config, instance_id=uuid.uuid4().hex)
    aux = args.aux_output_config
    if args.enable_routed_experts or args.enable_return_routed_experts or aux.enabled:
        cfg.enable_routed_experts = True
    if aux.enabled:
        logger.warning(
            "aux_output_config is deprecated in this build; routed experts are "
            "served by the Artifact Connector (use --enable-routed-experts)."
        )
        if aux.max_bytes is not None and cfg.capacity_bytes is None:
            cfg.capacity_bytes = aux.max_bytes
    args.artifact_config = cfg
    args.aux_output_config = AuxOutputConfig()


def routed_experts_row_spec(vllm_config: "VllmConfig") -> RowSpec:
    """Shape and dtype of one returned row: ``[num_hidden_layers, top_k]``."""
    model = vllm_config.model_config
    num_layers = model.get_total_num_hidden_layers()
    top_k = model.get_num_experts_per_tok()
    num_experts = model.get_num_experts()
    choice = vllm_config.artifact_config.routed_experts_dtype
    # The widest dtype ``choice`` may give (auto: uint8, else int16).
    widest = np.dtype(np.int16 if choice == "auto" else choice)
    if num_experts - 1 > np.iinfo(widest).max:
        allowed = (
            f"uint8 up to 256 experts, int16 up to {np.iinfo(np.int16).max + 1}"
            if choice == "auto"
            else f"up to {np.iinfo(widest).max + 1} experts"
        )
        raise ValueError(
            f"--enable-routed-experts: {num_experts} experts do not fit in "
            f"routed_experts_dtype {choice!r} ({allowed}); set "
            """--artifact-config '{"routed_experts_dtype": "int32"}'."""
        )
    if choice == "auto":
        return RowSpec.for_experts(num_layers, top_k, num_experts)
    return RowSpec(num_layers, top_k, np.dtype(choice))


def verify_artifact_config(vllm_config: "VllmConfig") -> None:
    """Reject, at startup, every configuration R3 cannot serve exactly. Each
    message names the fix."""
    cfg = vllm_config.artifact_config
    if vllm_config.aux_output_config.enabled:
        raise ValueError(
            "aux_output_config is not used by this build: enable routed experts "
            "with --enable-routed-experts (or ArtifactConfig("
            "enable_routed_experts=True))."
        )
    if not cfg.enable_routed_experts:
        return
    if vllm_config.model_config is None:
        raise ValueError("--enable-routed-experts needs a model configuration")
    flag = "--enable-routed-experts"
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config

    def reject(problem: str, fix: str) -> None:
        raise ValueError(f"{flag} {problem}; {fix}.")

    # Model Runner V1 exists up to vLLM 0.33 (use_v2_model_runner); 0.34
    # runs Model Runner V2 or, on CPUs without Triton, a standalone runner.
    has_v1 = hasattr(type(vllm_config), "use_v2_model_runner")
    if has_v1 and not vllm_config.use_v2_model_runner:
        reject(*_why_model_runner_v1(vllm_config))
    if _uses_standalone_cpu_model_runner():
        reject(
            "needs Model Runner V2's routed-experts capture, which the CPU model "
            "runner without Triton (vLLM's standalone CPU runner, used on non-x86 "
            "CPUs) does not have",
            "serve routed experts on a GPU, or on an x86 CPU",
        )
    if model.runner_type != "generate":
        reject(
            f"needs a generating model runner, got --runner {model.runner_type}",
            "routes exist only when generating; serve the model with --runner generate",
        )
    if not model.is_moe:
        reject(
            f"needs a Mixture-of-Experts model; {model.model} has no router",
            "drop the flag for this model",
        )
    subset = set(model.architectures) & SUBSET_MOE_ARCHITECTURES.keys()
    if subset:
        arch = sorted(subset)[0]
        reject(
            f"does not support {arch}: it {SUBSET_MOE_ARCHITECTURES[arch]}, so "
            "the captured routes of its tokens are not aligned with them",
            "drop the flag for this model",
        )
    if not vllm_config.cache_config.enable_prefix_caching:
        reject(*_why_prefix_caching_is_off(vllm_config))
    if parallel.pipeline_parallel_size > 1:
        reject(
            "does not support pipeline parallelism",
            "use --tensor-parallel-size instead of --pipeline-parallel-size",
        )
    if (
        parallel.decode_context_parallel_size > 1
        or parallel.prefill_context_parallel_size > 1
    ):
        reject(
            "does not support context parallelism",
            "drop --decode-context-parallel-size/--prefill-context-parallel-size",
        )
    if parallel.use_ubatching:
        reject(
            "does not support dual-batch overlap (micro-batching)",
            "drop --enable-dbo / --ubatch-size",
        )
    backend = parallel.distributed_executor_backend
    if isinstance(backend, type):
        backend = {"MultiprocExecutor": "mp", "UniProcExecutor": "uni"}.get(
            backend.__name__, backend.__name__
        )
    if backend not in (None, "mp", "uni"):
        reject(
            f"supports the mp and uni executors, got {backend!r}",
            "use --distributed-executor-backend mp",
        )
    kv = vllm_config.kv_transfer_config
    if kv is not None and (kv.kv_connector or kv.kv_role):
        check_kv_connectors(cfg, kv, reject)
    spec = vllm_config.speculative_config
    if spec is not None and spec.enable_adaptive_verification:
        reject(
            "does not support adaptive speculative verification",
            "turn enable_adaptive_verification off in --speculative-config",
        )
    if cfg.capacity_bytes is not None and cfg.capacity_bytes < MIN_CAPACITY_BYTES:
        reject(
            f"needs a store capacity of at least {MIN_CAPACITY_BYTES} bytes "
            f"({MIN_CAPACITY_BYTES >> 10} KiB: two arenas of the smallest size "
            "and the store's index), "
            f"got capacity_bytes={cfg.capacity_bytes}",
            "set --artifact-config "
            f"""'{{"capacity_bytes": {MIN_CAPACITY_BYTES}}}' or more""",
        )
    if cfg.inactive_ttl_s < MIN_INACTIVE_TTL_S:
        reject(
            f"needs an inactive_ttl_s of at least {MIN_INACTIVE_TTL_S:g} s (a "
            "shorter one removes live stores between their heartbeats), got "
            f"{cfg.inactive_ttl_s:g}",
            "set --artifact-config "
            f"""'{{"inactive_ttl_s": {MIN_INACTIVE_TTL_S:g}}}' or more""",
        )
    uses = {"ref_transport": cfg.ref_transport, "backend": cfg.backend}
    for field, value in uses.items():
        if value == "mooncake":
            check_mooncake(cfg, f"with {field} mooncake", reject)
    if cfg.backend == "mooncake":
        check_key_space(cfg, vllm_config, reject)
    routed_experts_row_spec(vllm_config)  # the dtype fits the experts
    # Last: it may create a directory (a fresh root); the sizes depend on
    # the root's file system.
    resolve_shm_root(cfg)
    size_from_node(cfg, parallel.tensor_parallel_size)


def check_prefix_caching_for_routed_experts(vllm_config: "VllmConfig") -> None:
    """Raise ``ValueError`` if R3 is on but prefix caching is off. For the
    engine core, once the KV cache specs are known: the base turns prefix
    caching off there for models with non-causal attention layers, after
    :func:`verify_artifact_config` accepted the configuration."""
    if not vllm_config.artifact_config.enable_routed_experts:
        return
    if vllm_config.cache_config.enable_prefix_caching:
        return
    import vllm.envs as envs

    cause = (
        "this model disables it: it has non-causal attention layers (e.g. "
        "prefix-LM attention), for which vLLM turns prefix caching off when "
        "the engine starts"
    )
    fix = "serve this model without --enable-routed-experts"
    if envs.VLLM_BATCH_INVARIANT:
        cause += (
            ", or VLLM_BATCH_INVARIANT=1 with the FLASHINFER or TRITON_MLA "
            "attention backend, which turns it off too"
        )
        fix += ", or unset VLLM_BATCH_INVARIANT (or choose another attention backend)"
    raise ValueError(
        "--enable-routed-experts needs prefix caching (KV block hashes key the "
        f"stored routes), but {cause}; {fix}."
    )


def _uses_standalone_cpu_model_runner() -> bool:
    """Whether Model Runner V2 runs as vLLM's standalone CPU runner (0.34 and
    later; it has none of the GPU runner's hooks). False where the platform
    cannot say (0.32)."""
    from vllm.platforms import current_platform

    check = getattr(current_platform, "uses_standalone_cpu_model_runner", None)
    return bool(check()) if check is not None else False


def _why_model_runner_v1(vllm_config: "VllmConfig") -> tuple[str, str]:
    """(problem, fix) for a configuration that runs the V1 model runner, in
    the order ``VllmConfig.use_v2_model_runner`` decides. Only vLLM up to 0.33
    has a V1 runner; the names read here are looked up, not imported, so the
    module loads where they are gone."""
    import vllm.config.vllm as vllm_module
    import vllm.envs as envs

    if getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", None) is not None:  # set to 0
        return (
            "needs Model Runner V2, and VLLM_USE_V2_MODEL_RUNNER=0 selects V1",
            "set VLLM_USE_V2_MODEL_RUNNER=1 (or unset it)",
        )
    if not getattr(vllm_module, "HAS_TRITON", True):
        return (
            "needs Model Runner V2, which vLLM does not use without Triton (it "
            "falls back to the V1 runner)",
            "install Triton, or set VLLM_USE_V2_MODEL_RUNNER=1 where Model "
            "Runner V2 runs without it",
        )
    unsupported: list[str] = getattr(
        vllm_config, "_get_v2_model_runner_unsupported_features", list
    )()
    if unsupported:
        features = ", ".join(unsupported)
        return (
            f"needs Model Runner V2, which does not support {features} (vLLM "
            "falls back to the V1 runner)",
            f"drop {features}; forcing VLLM_USE_V2_MODEL_RUNNER=1 does not make "
            "them work",
        )
    return ("needs Model Runner V2", "set VLLM_USE_V2_MODEL_RUNNER=1")


def _why_prefix_caching_is_off(vllm_config: "VllmConfig") -> tuple[str, str]:
    """(problem, fix) for prefix caching found off: whoever turned it off
    before the verifier (the base's config hooks and platform), else the
    user."""
    from vllm.platforms import CpuArchEnum, current_platform

    model = vllm_config.model_config
    need = "needs prefix caching (KV block hashes key the stored routes)"
    if vllm_config.is_mm_encoder_only:
        return (
            f"{need}, which vLLM turns off on an encoder-only instance "
            "(ec_transfer_config with an encode-only role: no language model runs)",
            "enable routed experts on the instances that generate instead",
        )
    for arch in model.architectures:
        if arch in MODELS_WITHOUT_PREFIX_CACHING:
            return (
                f"{need}, which {arch} turns off "
                f"({MODELS_WITHOUT_PREFIX_CACHING[arch]})",
                "drop the flag for this model",
            )
    if current_platform.is_cpu():
        if current_platform.get_cpu_architecture() == CpuArchEnum.RISCV:
            return (
                f"{need}, which vLLM turns off on RISC-V CPUs",
                "serve routed experts on an x86 or Arm CPU, or on a GPU",
            )
        if model.use_mla:
            return (
                f"{need}, which the CPU platform turns off for MLA models "
                "(unless its AMX MLA kernels run them)",
                "serve this model on a GPU or an x86 CPU with AMX, without "
                "--no-enable-prefix-caching",
            )
    if not model.is_prefix_caching_supported:
        return (
            f"{need}, which {model.model} does not support ({model.attn_type} "
            "attention), so vLLM leaves it off",
            "drop the flag for this model",
        )
    return (need, "remove --no-enable-prefix-caching")
