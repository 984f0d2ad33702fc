# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A full ``/dev/shm`` shared with other engines, engine-free: routes handed
out by reference, in a process whose ``/dev/shm`` is a small tmpfs of its
own (a private mount namespace), where another engine's files have taken
most of the room. A put that meets ``ENOSPC`` removes this engine's oldest
unreleased payloads (each a file of its own), one at a time, and is tried
again; with nothing of its own left to remove (every payload released) it
fails with the typed error naming the fix. (The store's own
evict-and-retry path: ``test_shm_store.py``, on a tmpfs under
``/dev/shm``.)"""

from __future__ import annotations

import json

from utils.shm_ns import run_python_in_small_shm, skip_unless_private_shm

CHILD = r"""
import json, os, sys
import numpy as np
from vllm.config.artifact import ArtifactConfig
from vllm.distributed.artifact_connector.route_refs import (
    RouteRefPublishError, RouteRefs)
from vllm_host_transport import routed_experts
from vllm_host_transport.routed_experts import RouteRefMissingError, fetch
from vllm_host_transport.routes_reader import release

# Another engine's files: 6 MiB of the 12 MiB tmpfs.
with open("/dev/shm/other-engine", "wb") as f:
    f.write(bytes(6 << 20))
# 1.5 MiB responses: a few fit in the room left.
refs = RouteRefs(ArtifactConfig(ref_scope="small-shm", ref_max_bytes=1 << 30))
rows = [np.full((32768, 6, 8), i, np.uint8) for i in range(8)]
out = {"published": 0}
handed = [refs.publish(r, 0) for r in rows]  # 12 MiB into 6 MiB of room
out["published"] = len(handed)
out["space_evictions"] = refs.space_evictions
out["newest_exact"] = all(bool((fetch(handed[-1]) == rows[-1]).all())
                          for _ in range(2))
try:
    fetch(handed[0])
    out["oldest"] = "fetched"
except RouteRefMissingError:
    out["oldest"] = "missing"
# Every rank read: the driver releases them all. Nothing of its own left;
# the other engine's file takes the rest.
release(handed)
with open("/dev/shm/other-engine", "ab") as f:
    f.write(bytes(os.statvfs("/dev/shm").f_bavail * 4096 - (256 << 10)))
try:
    refs.publish(rows[0], 0)
    out["full"] = "published"
except RouteRefPublishError as e:
    out["full"] = str(e)
out["waiting_bytes"] = refs.counters()["waiting_bytes"]
refs.close()
routed_experts.close()
print(json.dumps(out))
"""


def test_references_make_room_by_removing_their_own_oldest():
    skip_unless_private_shm()
    r = run_python_in_small_shm("12m", CHILD)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["published"] == 8, out
    assert out["space_evictions"] > 0, out
    assert out["newest_exact"] is True
    assert out["oldest"] == "missing"
    assert "/dev/shm is full" in out["full"] and "engines_per_node" in out["full"]
    # The released payloads were learnt before making room: none counts.
    assert out["waiting_bytes"] == 0, out
