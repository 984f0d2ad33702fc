# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``backend: mooncake``: artifact objects shared by every engine of a key
space through a Mooncake Store, so that a prefix hit on KV another engine
computed (a KV pool shared through storage, a prefill engine's KV) finds
its routes.

* :mod:`.client` - one Mooncake client per process and master;
* :mod:`.objects` - one Mooncake object per artifact object (header, bytes);
* :mod:`.key_space` - the terms engines of a key space must agree on;
* :mod:`.tiered` - :class:`SharedTierWriter`, the engine's ``/dev/shm``
  store with the shared tier behind it (the store contract's writer).
"""

from vllm.distributed.artifact_connector.mooncake.tiered import SharedTierWriter

__all__ = ["SharedTierWriter"]
