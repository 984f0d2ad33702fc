# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One Mooncake Store client per process and master, shared by whatever in
the process needs one (the artifact store's shared tier in the worker,
routes handed out by reference in the engine core; both in one process
under the ``uni`` executor), and closed when the last user lets go.

Mooncake's ``setup`` and ``close`` hold the interpreter lock while they run
(against a frozen master, until it resumes), and this process serves: each
runs only after the master answered a probe (``mooncake_probe.py``: a child
process joins it and asks once, killed after
:data:`~vllm_host_transport.mooncake_probe.PROBE_TIMEOUT_S`). A master that
does not answer cannot be joined (:class:`MooncakeUnavailableError`), and a
client of a master that does not answer when it is let go of is left open
until the process exits."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from vllm.distributed.artifact_connector.store import StoreIOError
from vllm.logger import init_logger
from vllm_host_transport.mooncake_probe import describe_error, probe

if TYPE_CHECKING:
    from vllm.config.artifact import ArtifactConfig

# Mooncake's error codes this package tells apart (mooncake/types.h).
OBJECT_NOT_FOUND = -704
BUFFER_TOO_SMALL = -600
RPC_FAIL = -900

logger = init_logger(__name__)

_lock = threading.Lock()
_clients: dict[tuple, tuple[Any, int]] = {}  # ident -> (client, users)
_idents: dict[int, tuple] = {}  # id(client) -> ident
_unclosed: list[Any] = []  # let go of while their master did not answer


class MooncakeUnavailableError(StoreIOError):
    """The Mooncake Store cannot be joined (client missing, master down)."""


def acquire(cfg: ArtifactConfig, *, segment_bytes: int | None = None) -> Any:
    """This process's client of ``cfg.mooncake_master`` (set up on first
    use; ``segment_bytes`` 0 joins without contributing memory). Pair with
    :func:`release`."""
    seg = cfg.mooncake_segment_bytes if segment_bytes is None else segment_bytes
    ident = (
        cfg.mooncake_master,
        cfg.mooncake_protocol,
        cfg.mooncake_local_hostname,
        seg,
    )
    with _lock:
        held = _clients.get(ident)
        if held is not None:
            _clients[ident] = (held[0], held[1] + 1)
            return held[0]
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise MooncakeUnavailableError(
                f"Mooncake's client is missing ({e}): pip install "
                "mooncake-transfer-engine-non-cuda"
            ) from e
        why = probe(
            str(cfg.mooncake_master),
            protocol=cfg.mooncake_protocol,
            local_hostname=cfg.mooncake_local_hostname,
        )
        if why is not None:
            raise MooncakeUnavailableError(
                f"cannot join the Mooncake Store of master {cfg.mooncake_master}: {why}"
            )
        client: Any = MooncakeDistributedStore()
        rc = client.setup(
            cfg.mooncake_local_hostname,
            "P2PHANDSHAKE",
            seg,
            cfg.mooncake_buffer_bytes,
            cfg.mooncake_protocol,
            "",
            cfg.mooncake_master,
        )
        if rc != 0:
            raise MooncakeUnavailableError(
                f"cannot join the Mooncake Store of master {cfg.mooncake_master}: "
                f"setup failed: {describe_error(rc)}"
            )
        _clients[ident] = (client, 1)
        _idents[id(client)] = ident
        return client


def own_segment(client: Any) -> Any:
    """A ``ReplicateConfig`` that places objects in ``client``'s own
    segment: what an engine shares lives and goes with that engine."""
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.preferred_segment = client.get_hostname()
    return config


def release(client: Any) -> None:
    """Let go of a client :func:`acquire` gave; the last release closes it."""
    with _lock:
        ident = _idents.get(id(client))
        held = _clients.get(ident) if ident is not None else None
        if ident is None or held is None or held[0] is not client:
            return
        if held[1] > 1:
            _clients[ident] = (client, held[1] - 1)
            return
        del _clients[ident], _idents[id(client)]
    why = probe(ident[0], protocol=ident[1], local_hostname=ident[2])
    if why is not None:
        logger.warning(
            "the Mooncake client of master %s is left open until this process "
            "exits (closing it now would stall the process): %s",
            ident[0],
            why,
        )
        _unclosed.append(client)  # alive: closing it at exit is Mooncake's
        return
    client.close()
