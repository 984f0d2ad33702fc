# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How much of ``/dev/shm`` an engine's routes may use: the store's limits
and defaults, defined once (the store imports them; a leaf module, so the
config imports no store), and the default sizes derived from the node:
of the routes store (``capacity_bytes``) and of the routes handed out by
reference that wait to be fetched (``ref_max_bytes``).

Every engine on a node (and every data-parallel rank: each has its own
store) shares one ``/dev/shm``. By default the engines together take at
most :data:`SHM_SHARE` of it, split evenly::

    per engine = SHM_SHARE * size of /dev/shm / engines per node
    capacity_bytes = 2/3 of that, at most 8 GiB
    ref_max_bytes  = 1/3 of that, at most 4 GiB

The other half stays for vLLM's own shared-memory segments, the trainer
and everything else on the node. How many engines share ``/dev/shm``: the
``engines_per_node`` setting, else ``$VLLM_ENGINES_PER_NODE``, else the
node's NVIDIA GPUs (``/proc/driver/nvidia/gpus``, all of them whatever
``CUDA_VISIBLE_DEVICES`` says) divided by the engine's tensor-parallel
size, else 1. A value the user sets for ``capacity_bytes`` or
``ref_max_bytes`` is kept as is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# ------------------------------------------------------- the store's limits
DEFAULT_CAPACITY_BYTES = 8 << 30
DEFAULT_INACTIVE_TTL_S = 3600.0
DEFAULT_COLLECT_INTERVAL_S = 300.0
HEARTBEAT_INTERVAL_S = 10.0
# Arenas are capacity / 16, clamped to [MIN_ARENA_BYTES, MAX_ARENA_BYTES].
MIN_ARENA_BYTES = 64 << 10
MAX_ARENA_BYTES = 64 << 20
# The smallest store that keeps serving puts: a full active arena is evicted
# only once the next one exists, so two arenas must fit next to the index
# log and the writer record (the third arena's room). With exactly two
# arenas the writer starts, but the first full arena stops every put.
MIN_CAPACITY_BYTES = 3 * MIN_ARENA_BYTES
# A store whose writer cannot be checked is judged by its heartbeat: a TTL
# must outlast a few heartbeat intervals, or a live writer's store (another
# pid namespace, or one not yet holding its writer record) is collected.
MIN_INACTIVE_TTL_S = 3 * HEARTBEAT_INTERVAL_S


def default_arena_bytes(capacity_bytes: int) -> int:
    """The arena size of a store of ``capacity_bytes``."""
    return min(MAX_ARENA_BYTES, max(MIN_ARENA_BYTES, capacity_bytes // 16))


# ------------------------------------------------- defaults from the node
ENGINES_ENV = "VLLM_ENGINES_PER_NODE"
#: Share of ``/dev/shm`` the engines of a node take together by default.
SHM_SHARE = 0.5
#: The largest default of ``ref_max_bytes``.
DEFAULT_REF_MAX_BYTES = 4 << 30
_GPUS_DIR = "/proc/driver/nvidia/gpus"


@dataclass(frozen=True)
class NodeSizes:
    engines: int
    engines_from: str  # where the count came from, for the log
    shm_bytes: int  # size of the file system under the store's root
    capacity_bytes: int
    ref_max_bytes: int


def engines_per_node(setting: int | None, tensor_parallel_size: int) -> tuple[int, str]:
    """How many engines (stores) share this node's ``/dev/shm``, and where
    that number came from. Raises ``ValueError`` (naming the fix) for a
    malformed environment variable."""
    if setting is not None:
        return setting, "engines_per_node"
    env = os.environ.get(ENGINES_ENV)
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(
                f"${ENGINES_ENV} must be a positive integer (the engines that "
                f"share this node's /dev/shm), got {env!r}; set it to e.g. 8, "
                "or unset it"
            )
        return n, f"${ENGINES_ENV}"
    try:
        gpus = len(os.listdir(_GPUS_DIR))
    except OSError:
        gpus = 0
    if gpus:
        tp = max(1, tensor_parallel_size)
        return max(1, gpus // tp), f"{gpus} GPUs / tensor parallel size {tp}"
    return 1, "no GPUs found"


def shm_size(root: str) -> int:
    """Size of the file system that holds ``root`` (or its nearest existing
    parent)."""
    path = root
    while True:
        try:
            st = os.statvfs(path)
            return st.f_blocks * st.f_frsize
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if parent == path:
                raise
            path = parent


def node_sizes(
    root: str, engines: int, engines_from: str, *, capacity_given: bool = False
) -> NodeSizes:
    """The default sizes for ``engines`` engines sharing the file system of
    ``root``. Raises ``ValueError`` (naming the fixes) when each engine's
    share is below the smallest store, unless the user gave the capacity
    (``capacity_given``: the derived one is then not used)."""
    total = shm_size(root)
    share = int(SHM_SHARE * total) // engines
    capacity = min(DEFAULT_CAPACITY_BYTES, share * 2 // 3)
    if capacity < MIN_CAPACITY_BYTES and not capacity_given:
        raise ValueError(
            f"the routed-experts store of each of {engines} engines sharing "
            f"{root}'s file system ({total / (1 << 20):.1f} MiB; engine count "
            f"from {engines_from}) would get {capacity} bytes, below the "
            f"smallest store ({MIN_CAPACITY_BYTES} bytes); give /dev/shm more "
            "room (e.g. `docker run --shm-size=16g`), or set "
            f"""--artifact-config '{{"capacity_bytes": {MIN_CAPACITY_BYTES}}}' """
            f"or more, or a lower engine count (engines_per_node, ${ENGINES_ENV})"
        )
    ref_max = max(1 << 20, min(DEFAULT_REF_MAX_BYTES, share // 3))
    return NodeSizes(engines, engines_from, total, capacity, ref_max)
