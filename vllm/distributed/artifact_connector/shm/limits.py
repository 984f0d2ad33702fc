# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``/dev/shm`` store's defaults and limits, defined once (the writer
and ``vllm/config/artifact.py`` import them; a leaf module, so the config
does not import the store)."""

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
