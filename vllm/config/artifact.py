# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Configuration of the Artifact Connector: routed experts (R3) returned with
each finished request, published through a same-node ``/dev/shm`` store."""

import dataclasses
import hashlib
import os
import uuid
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import Field

from vllm.config.utils import config
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig
    from vllm.distributed.artifact_connector.request_core import RowSpec
    from vllm.engine.arg_utils import EngineArgs

logger = init_logger(__name__)

RoutedExpertsDtype = Literal["auto", "uint16", "int32"]

# Key-value connectors whose KV never leaves this engine: CPU offload, with
# the role kv_both. Prefix hits they serve are ordinary local hits.
LOCAL_KV_CONNECTORS = ("OffloadingConnector", "SimpleCPUOffloadConnector")


DEFAULT_CAPACITY_BYTES = 8 << 30


def default_shm_root() -> str:
    return f"/dev/shm/vllm-artifacts-{os.geteuid()}"


@config
class ArtifactConfig:
    """Configuration of the Artifact Connector (routed experts, R3)."""

    enable_routed_experts: bool = False
    """Return, with each finished request, the routed expert IDs of every
    executed token in every decoder layer (``[N - 1, num_hidden_layers,
    top_k]``; layers without a router are zero rows)."""

    backend: Literal["shm"] = "shm"
    """Where routes are published: ``shm``, a same-node store under
    ``/dev/shm``."""

    shm_root: str = Field(default_factory=default_shm_root)
    """Directory of the store, strictly under ``/dev/shm`` (created 0700).
    Each engine (and data-parallel rank) gets its own store inside it."""

    capacity_bytes: int = Field(default=DEFAULT_CAPACITY_BYTES, gt=0)
    """Bytes the store may use in ``/dev/shm`` (per engine and data-parallel
    rank); the oldest unretained routes are evicted beyond it. A prefix-cache
    hit on evicted routes fails that request with ``ObjectMissingError``."""

    inactive_ttl_s: float = Field(default=3600.0, ge=0)
    """A store whose writer cannot be proven alive or dead is removed after
    this many seconds without a heartbeat (a dead writer's store goes at
    once)."""

    routed_experts_dtype: RoutedExpertsDtype = "auto"
    """dtype of the returned expert IDs: ``auto`` is uint8 up to 256 experts,
    else int16; ``uint16`` matches upstream vLLM's R3; ``int32``."""

    instance_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    """Identifies this engine's store. Generated: a fresh one is drawn for
    every engine, so a value given here is replaced."""

    def compute_hash(self) -> str:
        """Only the switch changes the compiled graph (it keeps the router
        outside it and binds the capture hooks)."""
        from vllm.config.utils import hash_factors

        return hash_factors({"enable_routed_experts": self.enable_routed_experts})

    def namespace(self, data_parallel_rank: int) -> str:
        """The store's namespace, the same in the worker that writes it and
        the engine core that reads it (both hold this config)."""
        digest = hashlib.sha256(f"{self.instance_id}:{data_parallel_rank}".encode())
        return digest.hexdigest()[:32]


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
        if aux.max_bytes is not None and cfg.capacity_bytes == DEFAULT_CAPACITY_BYTES:
            cfg.capacity_bytes = aux.max_bytes
    args.artifact_config = cfg
    args.aux_output_config = AuxOutputConfig()


def routed_experts_row_spec(vllm_config: "VllmConfig") -> "RowSpec":
    """Shape and dtype of one returned row: ``[num_hidden_layers, top_k]``."""
    from vllm.distributed.artifact_connector.request_core import RowSpec

    model = vllm_config.model_config
    num_layers = model.get_total_num_hidden_layers()
    top_k = model.get_num_experts_per_tok()
    num_experts = model.get_num_experts()
    choice = vllm_config.artifact_config.routed_experts_dtype
    if choice == "auto":
        return RowSpec.for_experts(num_layers, top_k, num_experts)
    if choice == "uint16" and num_experts > 1 << 16:
        raise ValueError(f"{num_experts} experts do not fit in uint16")
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

    if not vllm_config.use_v2_model_runner:
        reject("needs Model Runner V2", "set VLLM_USE_V2_MODEL_RUNNER=1")
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
    if not vllm_config.cache_config.enable_prefix_caching:
        reject(
            "needs prefix caching (KV block hashes key the stored routes)",
            "remove --no-enable-prefix-caching",
        )
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
        connectors = _kv_connectors(kv)
        names = [name for name, _ in connectors]
        foreign = [n for n in names if n not in LOCAL_KV_CONNECTORS]
        roles = {kv.kv_role, *(role for _, role in connectors if role)}
        if roles != {"kv_both"} or foreign or not connectors:
            reject(
                "does not support disaggregated prefill/decode KV transfer "
                f"(kv_connector={', '.join(names) or None}, "
                f"kv_role={', '.join(sorted(map(str, roles)))})",
                "only CPU KV offload (OffloadingConnector or "
                "SimpleCPUOffloadConnector) with kv_role=kv_both is supported",
            )
    spec = vllm_config.speculative_config
    if spec is not None and spec.enable_adaptive_verification:
        reject(
            "does not support adaptive speculative verification",
            "turn enable_adaptive_verification off in --speculative-config",
        )
    from vllm.distributed.safe_fs import UnsafePathError, shm_subdir

    try:
        shm_subdir(cfg.shm_root)
    except UnsafePathError as e:
        raise ValueError(f"artifact shm_root: {e}") from None
    routed_experts_row_spec(vllm_config)  # the dtype fits the experts


def _kv_connectors(kv) -> list[tuple[str, str | None]]:
    """(name, role) of the connector and, for a MultiConnector, of each one
    inside it (each has its own role)."""
    if kv.kv_connector != "MultiConnector":
        return [(kv.kv_connector, None)] if kv.kv_connector else []
    return [
        (c.get("kv_connector", "?"), c.get("kv_role"))
        for c in (kv.kv_connector_extra_config or {}).get("connectors", [])
    ]
