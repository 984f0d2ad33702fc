# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The parts of the routed-experts configuration that depend on this node,
resolved once when the configuration is built (in the process that builds
it, so every engine process gets them with the configuration): the store
root under ``/dev/shm``, taken before any other local user can, and the
sizes left unset, derived from ``/dev/shm`` and the engines that share it
(``artifact_sizing.py``)."""

import os
import re

from vllm.config import artifact_settings
from vllm.config.artifact_settings import ArtifactConfig
from vllm.config.artifact_sizing import (
    DEFAULT_REF_MAX_BYTES,
    engines_per_node,
    node_sizes,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


def size_from_node(cfg: ArtifactConfig, tensor_parallel_size: int) -> None:
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


def resolve_shm_root(cfg: ArtifactConfig) -> None:
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
    default = artifact_settings.default_shm_root()
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
