# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``ArtifactConfig``: the settings of the Artifact Connector (routed
experts, R3, returned with each finished request and published through a
same-node ``/dev/shm`` store), their defaults and the store's identity.
Checked and resolved against the node by ``vllm/config/artifact.py``; the
lowest module of the configuration (the checks import it, never the other
way round)."""

import hashlib
import os
import uuid
from typing import Literal

from pydantic import Field

from vllm.config.artifact_sizing import DEFAULT_INACTIVE_TTL_S
from vllm.config.utils import config

RoutedExpertsDtype = Literal["auto", "uint16", "int32"]

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
    """Seconds a reference's routes stay readable before they are removed
    (unless released earlier: ``routes_reader.release``)."""

    ref_versions_kept: int = Field(default=2, ge=0)
    """Weight versions whose references stay readable: when the engine's
    weight version changes (``update_weight_version``), the references of
    versions older than the last ``ref_versions_kept`` are removed (2: the
    current one and the one before, which an asynchronous trainer may still
    be training on). 0: never by version (only release, TTL and bounds)."""

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
