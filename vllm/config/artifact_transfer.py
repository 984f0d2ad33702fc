# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Startup checks of R3 with what moves KV or routes beyond the engine: KV
connectors, the Mooncake Store (``backend`` and ``ref_transport``
``mooncake``) and the shared key space. Called by
``verify_artifact_config``; each ``reject(problem, fix)`` raises the
``ValueError`` naming the fix."""

import os
import re
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config.artifact_settings import ArtifactConfig
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
    KV other engines computed need the shared one, and run alone; nothing
    else runs. Each connector of a MultiConnector is checked with its own
    role."""
    connectors = _kv_connectors(kv)
    names = [name for name, _ in connectors]
    roles = {kv.kv_role, *(role for _, role in connectors if role)}
    shared = [n for n in names if n in SHARED_KV_CONNECTORS]
    foreign = [n for n in names if n not in LOCAL_KV_CONNECTORS + SHARED_KV_CONNECTORS]
    local_ok = all(
        (role or kv.kv_role) == "kv_both"
        for name, role in connectors
        if name in LOCAL_KV_CONNECTORS
    )
    if not connectors or foreign or not local_ok:
        reject(
            "does not support this KV transfer "
            f"(kv_connector={', '.join(names) or None}, "
            f"kv_role={', '.join(sorted(map(str, roles)))})",
            "CPU KV offload (OffloadingConnector or SimpleCPUOffloadConnector) "
            "with kv_role=kv_both, and ExampleConnector (shared storage, any "
            """role) with --artifact-config '{"backend": "mooncake", ...}' """
            "are supported",
        )
    if shared and len(connectors) > 1:
        # A MultiConnector offers the hit of its first connector that has
        # one; the cut to blocks whose routes are local must apply to shared
        # KV only, and which connector a hit came from is MultiConnector's
        # private state. Refused rather than guessed.
        reject(
            f"with a MultiConnector of {', '.join(names)} cannot tell which "
            "connector a prefix hit came from, so it cannot keep the routes "
            "of loaded blocks exact (a cut meant for ExampleConnector's hits "
            "would also cut CPU offload's)",
            "use ExampleConnector alone (with backend mooncake), or CPU offload alone",
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


# The deployment secret of backend mooncake: the file the config names, or
# else the secret itself in this environment variable.
SHARED_SECRET_ENV = "VLLM_ROUTED_EXPERTS_SECRET"
MIN_SHARED_SECRET_BYTES = 16
_MAX_SHARED_SECRET_BYTES = 4096
_SECRET_FIX = (
    "write at least 16 random bytes to a file only you can read (e.g. "
    "`head -c 32 /dev/urandom > secret && chmod 600 secret`) and set "
    """--artifact-config '{"shared_secret_file": "/path/to/secret", ...}' """
    f"on every engine of the key space, or set {SHARED_SECRET_ENV} to the "
    "same secret on each"
)


class SharedSecretError(ValueError):
    """The deployment secret of ``backend: mooncake`` is missing or unsafe:
    ``problem``, and ``fix`` (by default how to provide one)."""

    def __init__(self, problem: str, fix: str = _SECRET_FIX) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem, self.fix = problem, fix


def shared_secret(cfg: "ArtifactConfig") -> bytes:
    """The deployment secret that authenticates the key space's shared
    objects: the bytes of ``shared_secret_file`` (read without following a
    symlink; it must be a regular file of this user that no one else may
    read), else those of ``$VLLM_ROUTED_EXPERTS_SECRET``. The secret is
    bytes, used as they are: random bytes (``head -c 32 /dev/urandom``) and
    hex or base64 text alike. Only one trailing newline (``\\n`` or
    ``\\r\\n``, as an editor or ``echo`` leaves it) is not part of it; every
    other byte is, whitespace included (random secrets hold such bytes).
    Raises :class:`SharedSecretError` with the fix."""
    if cfg.shared_secret_file:
        path = cfg.shared_secret_file
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise SharedSecretError(
                f"cannot open shared_secret_file {path!r} ({e.strerror}, and "
                "a symlink is refused)"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise SharedSecretError(
                    f"shared_secret_file {path!r} is not a regular file owned "
                    "by this user"
                )
            if st.st_mode & 0o077:
                raise SharedSecretError(
                    f"shared_secret_file {path!r} is open to other users "
                    f"(mode {st.st_mode & 0o777:o})",
                    "chmod 600 it",
                )
            raw = os.read(fd, _MAX_SHARED_SECRET_BYTES + 1)
        finally:
            os.close(fd)
        where = f"shared_secret_file {path!r}"
    else:
        raw = os.environ.get(SHARED_SECRET_ENV, "").encode()
        where = SHARED_SECRET_ENV
        if not raw:
            raise SharedSecretError(
                "with backend mooncake needs a deployment secret to "
                "authenticate shared routes (anyone who reaches the master "
                "could otherwise plant them)"
            )
    secret = _without_trailing_newline(raw)
    if not MIN_SHARED_SECRET_BYTES <= len(secret) <= _MAX_SHARED_SECRET_BYTES:
        raise SharedSecretError(
            f"the secret in {where} must hold {MIN_SHARED_SECRET_BYTES} to "
            f"{_MAX_SHARED_SECRET_BYTES} bytes, got {len(secret)}"
        )
    return secret


def _without_trailing_newline(raw: bytes) -> bytes:
    for end in (b"\r\n", b"\n"):
        if raw.endswith(end):
            return raw[: -len(end)]
    return raw


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
    try:
        shared_secret(cfg)
    except SharedSecretError as e:
        reject(e.problem, e.fix)
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
