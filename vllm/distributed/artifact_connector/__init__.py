# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Artifact Connector: immutable, KV-hash-aligned per-token artifacts (R3
routed-expert IDs) published by the worker and read back by the scheduler.

Engine-independent parts:

* :mod:`.store` - backend-neutral immutable-object contract and errors.
* :mod:`.shm` - the same-node ``/dev/shm`` backend.
* :mod:`.request_core` - keys, object envelopes, coverage, materialisation.
* :mod:`.buffer` - the worker's logical per-request row buffer.
* :mod:`.protocol` - scheduler <-> worker messages.
"""
