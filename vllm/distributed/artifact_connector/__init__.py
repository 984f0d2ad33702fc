# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Artifact Connector: immutable, KV-hash-aligned per-token artifacts (R3
routed-expert IDs) published by the worker and read back by the scheduler.

Worker side (global rank 0, one per engine):

* ``ArtifactPublisher.apply`` - take a step's scheduler messages (attempt
  starts, block hashes, finalisations and aborts, discards, releases).
* ``ArtifactPublisher.write_step`` - buffer a step's captured rows in the
  row slab (``buffer.RowSlab``), by logical token position.
* ``ArtifactPublisher.flush`` - hand what the step made publishable to the
  publication thread (one ``put_batch`` per step, off the step loop).
* ``ArtifactPublisher.report`` - acknowledgements and failures.
* ``ArtifactPublisher.set_weight_version`` - rows from now on belong to new
  weights (keys carry the version per block).

Scheduler side:

* ``protocol.ArtifactSchedulerMeta`` - what the scheduler sends each step.
* ``request_core.read_batch`` - read many requests' rows ``[first_row, N -
  1)`` from the refs of their ``FinalizeAck`` at once, every object verified
  (``read_rows``: one request).
* ``route_reader.RouteReader`` - does those reads on its own thread, so the
  engine thread never waits on one.
* ``protocol.Release`` - after reading, release what the attempt retained.

Store (``store`` contract, ``shm`` backend): ``ShmStoreWriter.put_batch``,
``retain``/``release``, ``lookup``, ``maintain``; ``ShmStoreReader.read_into``.
"""
