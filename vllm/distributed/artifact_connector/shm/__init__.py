# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The same-node artifact store under a trusted ``/dev/shm`` root.

One store is one *namespace* with one writer process::

    <root>/                  0700, owned by the engine's user
      <namespace>/           0700; 32 hex characters, fresh per engine
        writer.json          0600; pid, process start time, boot id
        index.log            0600; header + batches of 64-byte records
        <16 hex>.arena       0600; object data, allocated in full
        <16 hex>.tmp         0600; a log snapshot being written

One module per job:

* :mod:`.writer` - :class:`ShmStoreWriter`: batched puts, eviction, upkeep
  (spare arena, log compaction, collection).
* :mod:`.files` - the store's directory, writer record and index log;
  :mod:`.repair` - noticing files removed behind the writer;
  :mod:`.retention` - which keys live attempts hold; :mod:`.space` - a
  full ``/dev/shm``. The defaults and limits are in
  ``vllm/config/artifact_sizing.py``.
* :mod:`.reader` - :class:`ShmStoreReader`: verified reads into a buffer.
* :mod:`.log` - the index log's format; :mod:`.index` - the in-memory index.
* :mod:`.arena` - arena files; :mod:`.collect` - writer identity and the
  collection of stale stores.

Safe file handling is shared with the host transport
(:mod:`vllm_host_transport.safe_fs`).
"""

from vllm.config.artifact_sizing import (
    DEFAULT_CAPACITY_BYTES,
    DEFAULT_INACTIVE_TTL_S,
)
from vllm.distributed.artifact_connector.shm.collect import (
    CollectReport,
    WriterIdentity,
    collect_stale_stores,
    make_namespace,
)
from vllm.distributed.artifact_connector.shm.reader import ShmStoreReader
from vllm.distributed.artifact_connector.shm.writer import ShmStoreWriter

__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "DEFAULT_INACTIVE_TTL_S",
    "CollectReport",
    "ShmStoreReader",
    "ShmStoreWriter",
    "WriterIdentity",
    "collect_stale_stores",
    "make_namespace",
]
