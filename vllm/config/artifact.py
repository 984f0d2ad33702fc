# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Configuration of the Artifact Connector: routed experts (R3) returned with
each finished request, published through a same-node ``/dev/shm`` store."""

import dataclasses
import hashlib
import os
import re
import uuid
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import Field

from vllm.config.artifact_sizing import (
    DEFAULT_INACTIVE_TTL_S,
    DEFAULT_REF_MAX_BYTES,
    MIN_CAPACITY_BYTES,
    MIN_INACTIVE_TTL_S,
    engines_per_node,
    node_sizes,
)
from vllm.config.artifact_transfer import (
    check_key_space,
    check_kv_connectors,
    check_mooncake,
)
from vllm.config.utils import config
from vllm.logger import init_logger
from vllm.utils.routed_experts_rows import RowSpec

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

logger = init_logger(__name__)

RoutedExpertsDtype = Literal["auto", "uint16", "int32"]

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


# Routes handed out by reference that may wait unfetched: at most 4 GiB
# (DEFAULT_REF_MAX_BYTES: about 320 responses of 32k tokens of a 48-layer
# top-8 model; less on a small /dev/shm: artifact_sizing.py), for 10 minutes.
DEFAULT_REF_TTL_S = 600.0
DEFAULT_REF_HANDOFF_TIMEOUT_S = 5.0
# The frontend's own deadline for a held request sums the engine's bounds.
MAX_REF_HANDOFF_TIMEOUT_S = 30.0
# How long a request offered another engine's KV waits for its routes' pull.
DEFAULT_SHARED_PULL_TIMEOUT_S = 1.0


def default_shm_root() -> str:
    return f"/dev/shm/vllm-artifacts-{os.geteuid()}"


@config
class ArtifactConfig:
    """Configuration of the Artifact Connector (routed experts, R3)."""

    enable_routed_experts: bool = False
    """Return, with each finished request, the routed expert IDs of every
    executed token in every decoder layer (``[N - 1, num_hidden_layers,
    top_k]``; layers without a router are zero rows)."""

    backend: Literal["shm", "mooncake"] = "shm"
    """Where routes are published: ``shm``, a same-node store under
    ``/dev/shm``, private to this engine; ``mooncake``, that store with a
    Mooncake Store (``mooncake_master``) behind it, shared by every engine of
    ``key_space``, so that a prefix hit on KV another engine computed (a KV
    pool shared through ``ExampleConnector`` storage, a prefill engine's KV)
    finds that engine's routes."""

    key_space: str | None = None
    """Name of the engines that share routes (``backend: mooncake``; needed
    there). Their keys are comparable only if they hash blocks alike: same
    model, ``--prefix-caching-hash-algo``, ``PYTHONHASHSEED`` and
    ``--block-size``; the first engine records these in the store and an
    engine that differs refuses to start."""

    shm_root: str = Field(default_factory=lambda: default_shm_root())
    """Directory of the store, strictly under ``/dev/shm`` (created 0700).
    Each engine (and data-parallel rank) gets its own store inside it. If
    the default one is held by another user, a fresh private directory next
    to it is used instead (with a warning)."""

    capacity_bytes: int | None = Field(default=None, gt=0)
    """Bytes the store may use in ``/dev/shm`` (per engine and data-parallel
    rank), at least ``MIN_CAPACITY_BYTES`` (two of the smallest arenas); the
    oldest unretained routes are evicted beyond it, and while ``/dev/shm``
    itself is full. A prefix-cache hit on evicted routes fails that request
    with ``ObjectMissingError``. ``None`` (the default): derived from the
    node when the configuration is built, 2/3 of this engine's share of half
    of ``/dev/shm`` (``engines_per_node``), at most 8 GiB."""

    engines_per_node: int | None = Field(default=None, gt=0)
    """How many engines (data-parallel ranks counted one each) share this
    node's ``/dev/shm``, for the default ``capacity_bytes`` and
    ``ref_max_bytes``. ``None``: ``$VLLM_ENGINES_PER_NODE``, else the node's
    NVIDIA GPUs divided by the tensor-parallel size, else 1."""

    inactive_ttl_s: float = Field(default=DEFAULT_INACTIVE_TTL_S, ge=0)
    """A store whose writer cannot be proven alive or dead is removed after
    this many seconds without a heartbeat (a dead writer's store goes at
    once); at least ``MIN_INACTIVE_TTL_S``."""

    routed_experts_dtype: RoutedExpertsDtype = "auto"
    """dtype of the returned expert IDs: ``auto`` is uint8 up to 256 experts,
    else int16; ``uint16`` matches upstream vLLM's R3; ``int32``."""

    routed_experts_format: Literal["inline", "ref"] = "inline"
    """How finished requests return their routes unless a request chooses
    (its own ``routed_experts_format``): ``inline``, the array in the
    response (base64 ``.npy`` over HTTP, ``CompletionOutput.routed_experts``
    offline); ``ref``, a ``routed_experts_ref`` naming the array in this
    node's host transport, for a process of the same user to take with
    ``vllm_host_transport.routed_experts.fetch`` (the array never passes
    through the API server)."""

    ref_scope: str | None = None
    """Host-transport scope references are handed out in; the consumer needs
    nothing but the reference (it names the scope). ``None``: the
    ``VLLM_HOST_TRANSPORT_SCOPE`` environment variable, else one derived from
    this engine's login session."""

    ref_max_bytes: int | None = Field(default=None, gt=0)
    """Bytes of routes that may wait unfetched in the host transport; the
    oldest are removed beyond it, and while ``/dev/shm`` is full (their
    ``fetch`` then fails with ``RouteRefMissingError``). ``None`` (the
    default): derived from the node, 1/3 of this engine's share of half of
    ``/dev/shm``, at most 4 GiB (4 GiB with ``ref_transport: mooncake``)."""

    ref_ttl_s: float = Field(default=DEFAULT_REF_TTL_S, gt=0)
    """Seconds a reference's routes wait to be fetched before they are
    removed."""

    ref_handoff_timeout_s: float = Field(
        default=DEFAULT_REF_HANDOFF_TIMEOUT_S, gt=0, le=MAX_REF_HANDOFF_TIMEOUT_S
    )
    """Seconds a finished request waits for its routes to be handed out by
    reference (its put into ``ref_transport``); past it the request ends with
    ``RouteRefPublishError`` and no routes, and while the transport stays
    that slow later references fail at once, retried after a pause of 1 s
    doubling to 8 s. Inline requests never wait for a hand-off."""

    ref_transport: Literal["host", "mooncake"] = "host"
    """Where references' routes wait: ``host``, this node's host transport
    (a consumer on this node); ``mooncake``, a Mooncake Store
    (``mooncake_master``), which consumers on any host that reaches its
    master fetch from (``pip install mooncake-transfer-engine-non-cuda``)."""

    mooncake_master: str | None = None
    """``host:port`` of the Mooncake master, for ``backend: mooncake`` and
    ``ref_transport: mooncake``."""

    shared_secret_file: str | None = None
    """``backend: mooncake``: a file holding the deployment secret (16 bytes
    or more; a regular file of this user, mode 0600, not a symlink), the
    same on every engine of ``key_space``; its bytes, less one trailing
    newline, are the secret (random bytes, or hex or base64 text). Every
    shared object carries a keyed BLAKE2b MAC of its key, header and bytes
    under it; an object that fails it is treated as missing (recomputed).
    Without this field the secret itself is read from
    ``$VLLM_ROUTED_EXPERTS_SECRET``; with neither, the engine refuses
    ``backend: mooncake``."""

    shared_pull_timeout_s: float = Field(
        default=DEFAULT_SHARED_PULL_TIMEOUT_S, gt=0, le=10.0
    )
    """``backend: mooncake``: seconds a request offered KV another engine
    computed waits, before it is scheduled, for the blocks' routes to be
    pulled from the shared tier into this engine's store; past it the
    blocks whose routes are not local are recomputed (exact, slower). A
    call into the tier (a pull, a mirror of this engine's objects) that
    takes longer pauses the tier: pulls end at once and mirrors are skipped
    (counted in ``vllm:routed_experts_store_shared_failures``), retried
    after 1 s, doubling to 8 s."""

    mooncake_protocol: str = "tcp"
    """Mooncake's transfer protocol (``tcp``, or ``rdma`` where the node has
    it)."""

    mooncake_local_hostname: str = "127.0.0.1"
    """The address under which this engine's Mooncake segment is reached by
    the consumers (its host name or IP on their network; loopback serves
    consumers on this node only)."""

    mooncake_segment_bytes: int = Field(default=1 << 30, gt=0)
    """Bytes of memory this engine (each process that joins: the worker for
    ``backend: mooncake``, the engine core for ``ref_transport: mooncake``)
    contributes to the Mooncake Store. The engine puts what it shares there
    (routes handed out, shared objects), in its own segment: they live until
    removed or evicted by Mooncake under pressure, and go when the engine
    stops."""

    mooncake_buffer_bytes: int = Field(default=256 << 20, gt=0)
    """Bytes of this engine's Mooncake transfer buffer (at least the largest
    response's routes)."""

    instance_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    """Identifies this engine's store. Generated: a fresh one is drawn for
    every engine, so a value given here is replaced."""

    def compile_factors(self) -> dict[str, object]:
        """Only the switch changes the compiled graph (the capture hooks are
        bound into it). vLLM 0.34 keys its compile cache on these."""
        return {"enable_routed_experts": self.enable_routed_experts}

    def compute_hash(self) -> str:
        """The compile factors hashed, for vLLM 0.32's compile cache key."""
        from vllm.config.utils import hash_factors

        return hash_factors(self.compile_factors())

    def namespace(self, data_parallel_rank: int) -> str:
        """The store's namespace, the same in the worker that writes it and
        the engine core that reads it (both hold this config)."""
        digest = hashlib.sha256(f"{self.instance_id}:{data_parallel_rank}".encode())
        return digest.hexdigest()[:32]

    def key_namespace(self, data_parallel_rank: int) -> str:
        """What object keys are derived under: the shared ``key_space`` for
        ``backend: mooncake`` (every engine and rank alike), else this
        store's own namespace."""
        if self.backend == "mooncake":
            return f"key-space:{self.key_space}"
        return self.namespace(data_parallel_rank)


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
    _resolve_shm_root(cfg)
    _size_from_node(cfg, parallel.tensor_parallel_size)


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


def _size_from_node(cfg: ArtifactConfig, tensor_parallel_size: int) -> None:
    """Fill in the sizes the user left unset from the node's ``/dev/shm``
    and the engines that share it (``artifact_sizing.py``); explicit values are
    kept. Logged once, with where the engine count came from."""
    if cfg.capacity_bytes is not None and (
        cfg.ref_max_bytes is not None or cfg.ref_transport == "mooncake"
    ):
        cfg.ref_max_bytes = cfg.ref_max_bytes or DEFAULT_REF_MAX_BYTES
        return
    try:
        engines, source = engines_per_node(cfg.engines_per_node, tensor_parallel_size)
        sizes = node_sizes(
            cfg.shm_root, engines, source, capacity_given=cfg.capacity_bytes is not None
        )
    except (ValueError, OSError) as e:
        raise ValueError(f"--enable-routed-experts: {e}") from None
    if cfg.capacity_bytes is None:
        cfg.capacity_bytes = sizes.capacity_bytes
    if cfg.ref_max_bytes is None:
        cfg.ref_max_bytes = (
            DEFAULT_REF_MAX_BYTES
            if cfg.ref_transport == "mooncake"
            else sizes.ref_max_bytes
        )
    logger.info(
        "Routed experts: /dev/shm (%s) holds %.1f GiB, shared by %d engines "
        "(%s): capacity_bytes %d, ref_max_bytes %d",
        cfg.shm_root,
        sizes.shm_bytes / (1 << 30),
        engines,
        source,
        cfg.capacity_bytes,
        cfg.ref_max_bytes,
    )


def _resolve_shm_root(cfg: ArtifactConfig) -> None:
    """Take the store root before any process starts: create it (each
    missing component 0700, no symlink followed) or check it, here in the
    process that builds the configuration, so that no other local user can
    create it between now and the worker's store (after model load). An
    explicit root that cannot be made private (ours, 0700, a real
    directory) is refused with ``ValueError`` naming the fix. The default
    root, which another local user can create first, is replaced by a fresh
    private directory next to it (every engine process gets it with the
    configuration) rather than stop the engine."""
    from vllm_host_transport.safe_fs import (
        UnsafePathError,
        check_private_shm_dir,
        ensure_private_shm_dir,
        make_private_shm_dir,
        shm_subdir,
    )

    root = cfg.shm_root
    default = default_shm_root()
    try:
        shm_subdir(root)
    except UnsafePathError as e:
        if root != default:
            raise ValueError(f"artifact shm_root: {e}") from None
    try:
        # The check first names what is wrong with an existing component
        # (without opening it); the creation checks each component again.
        check_private_shm_dir(root)
        ensure_private_shm_dir(root)
        return
    except (UnsafePathError, OSError) as e:
        if root != default:
            raise ValueError(
                f"artifact shm_root: {e}; make it a directory of this user with "
                f"mode 0700 (`chmod 700 {root}` if it is yours), or set "
                """--artifact-config '{"shm_root": ...}' to another directory """
                "under /dev/shm (a missing one is created 0700)"
            ) from None
        problem = str(e)
    try:
        fresh = make_private_shm_dir(default)
    except (UnsafePathError, OSError) as e:
        raise ValueError(
            f"artifact shm_root: the default {default} cannot be used ({problem}) "
            f"and no fresh directory could be created next to it ({e}); set "
            """--artifact-config '{"shm_root": ...}' to a directory of this user """
            "under /dev/shm"
        ) from None
    logger.warning(
        "Routed experts: the default artifact store root %s cannot be used: %s "
        "(owner: %s). It may have been created by another local user. Using a "
        "fresh private root %s instead; remove %s (as its owner or root) to "
        "return to the default.",
        default,
        problem,
        _owner(default),
        fresh,
        default,
    )
    cfg.shm_root = fresh
    _collect_abandoned_roots(default, fresh, cfg.inactive_ttl_s)


def _owner(path: str) -> str:
    from vllm_host_transport.safe_fs import owner_name

    try:
        return owner_name(os.stat(path, follow_symlinks=False).st_uid)
    except OSError:
        return "unknown"


def _collect_abandoned_roots(default: str, fresh: str, inactive_ttl_s: float) -> None:
    """Stores of crashed engines in earlier fresh roots (``<default>-<hex>``)
    would stay forever, as no later engine uses those roots: collect the
    stale ones (dead or expired writers only; live stores and anything not
    ours are left alone). The empty roots themselves stay: one may belong to
    an engine that has not started its writer yet."""

    from vllm.distributed.artifact_connector.shm import collect_stale_stores

    parent, stem = os.path.split(os.path.realpath(default))
    pattern = re.compile(re.escape(stem) + r"-[0-9a-f]{16}\Z")
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        path = os.path.join(parent, name)
        if pattern.match(name) is None or path == fresh:
            continue
        try:
            collect_stale_stores(path, inactive_ttl_s)
        except (RuntimeError, OSError) as e:  # unsafe: not ours, left alone
            logger.debug("artifact store: not collecting %s: %s", path, e)
