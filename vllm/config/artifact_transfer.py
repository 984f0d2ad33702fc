# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Startup checks of R3 with what moves KV or routes beyond the engine: KV
connectors, the Mooncake Store (``backend`` and ``ref_transport``
``mooncake``) and the shared key space. Called by
``verify_artifact_config``; each ``reject(problem, fix)`` raises the
``ValueError`` naming the fix."""

import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config.artifact import ArtifactConfig
    from vllm.config.vllm import VllmConfig

Reject = Callable[[str, str], None]

# Key-value connectors whose KV never leaves this engine: CPU offload, with
# the role kv_both. Prefix hits they serve are ordinary local hits.
LOCAL_KV_CONNECTORS = ("OffloadingConnector", "SimpleCPUOffloadConnector")

# Key-value connectors that load KV other engines computed, in any role (a
# shared KV pool, a prefill engine handing KV to a decode engine): their hits
# need the routes those engines published, so they need backend mooncake.
SHARED_KV_CONNECTORS = ("ExampleConnector",)


def check_kv_connectors(cfg: "ArtifactConfig", kv, reject: Reject) -> None:
    """CPU offload (kv_both) runs with either backend; connectors that load
    KV other engines computed need the shared one; nothing else runs."""
    connectors = _kv_connectors(kv)
    names = [name for name, _ in connectors]
    roles = {kv.kv_role, *(role for _, role in connectors if role)}
    shared = [n for n in names if n in SHARED_KV_CONNECTORS]
    foreign = [n for n in names if n not in LOCAL_KV_CONNECTORS + SHARED_KV_CONNECTORS]
    local_only = not shared and roles == {"kv_both"}
    if not connectors or foreign or not (local_only or shared):
        reject(
            "does not support this KV transfer "
            f"(kv_connector={', '.join(names) or None}, "
            f"kv_role={', '.join(sorted(map(str, roles)))})",
            "CPU KV offload (OffloadingConnector or SimpleCPUOffloadConnector) "
            "with kv_role=kv_both, and ExampleConnector (shared storage, any "
            """role) with --artifact-config '{"backend": "mooncake", ...}' """
            "are supported",
        )
    if shared and cfg.backend != "mooncake":
        reject(
            f"with {shared[0]} loads KV other engines computed, whose routes "
            "are not in this engine's own store",
            """set --artifact-config '{"backend": "mooncake", "key_space": ..., """
            """"mooncake_master": "host:port"}' on every engine that shares KV""",
        )


def loads_shared_kv(kv) -> bool:
    """Whether a connector of ``kv`` loads KV other engines computed. Only
    those hits are cut to the blocks whose routes the shared tier has: CPU
    offload's KV is this engine's own, with its routes in the local store,
    and OffloadingConnector expects the hit it offered (a chunk's partial
    tail included) to be taken whole."""
    return kv is not None and any(
        name in SHARED_KV_CONNECTORS for name, _ in _kv_connectors(kv)
    )


def check_mooncake(cfg: "ArtifactConfig", what: str, reject: Reject) -> None:
    if not cfg.mooncake_master or not re.fullmatch(
        r"[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}", cfg.mooncake_master
    ):
        reject(
            f"{what} needs the Mooncake master's address as host:port, got "
            f"mooncake_master {cfg.mooncake_master!r}",
            """set --artifact-config '{"mooncake_master": "10.0.0.5:50051", ...}'""",
        )
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        reject(
            f"{what} needs Mooncake's client ({e})",
            "pip install mooncake-transfer-engine-non-cuda (and, on Debian, "
            "apt-get install libibverbs1 librdmacm1 liburing2)",
        )


def check_key_space(
    cfg: "ArtifactConfig", vllm_config: "VllmConfig", reject: Reject
) -> None:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import _NON_CRYPTO_HASH_FUNCTIONS

    if not cfg.key_space:
        reject(
            "with backend mooncake needs the name of the engines that share "
            "routes, key_space",
            """set --artifact-config '{"backend": "mooncake", "key_space": """
            """"my-deployment", ...}', the same on every engine that shares KV""",
        )
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    seeded = os.environ.get("PYTHONHASHSEED") is not None
    if get_hash_fn_by_name(algo) in _NON_CRYPTO_HASH_FUNCTIONS and not seeded:
        reject(
            f"with backend mooncake needs block hashes other engines can "
            f"reproduce, but --prefix-caching-hash-algo {algo} is seeded at "
            "random in each engine when PYTHONHASHSEED is unset",
            "set PYTHONHASHSEED to the same value on every engine of the key "
            "space, or use --prefix-caching-hash-algo sha256",
        )


def _kv_connectors(kv) -> list[tuple[str, str | None]]:
    """(name, role) of the connector and, for a MultiConnector, of each one
    inside it (each has its own role)."""
    if kv.kv_connector != "MultiConnector":
        return [(kv.kv_connector, None)] if kv.kv_connector else []
    return [
        (c.get("kv_connector", "?"), c.get("kv_role"))
        for c in (kv.kv_connector_extra_config or {}).get("connectors", [])
    ]
