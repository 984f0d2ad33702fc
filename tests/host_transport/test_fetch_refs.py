# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``routed_experts.fetch`` on the host transport: what a fetched array
costs ``/dev/shm``, what malformed references raise, and what fetches of
stale locations leave behind. Real producers and the real ``/dev/shm`` (a
private small tmpfs where free space is measured)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from utils.shm_ns import skip_unless_private_shm, small_shm_argv

PIN_CHILD = r"""
import json, os, secrets
import numpy as np
from vllm_host_transport import HostTransportConfig, HostTransportConnector
from vllm_host_transport import routed_experts
from vllm_host_transport.routed_experts import (
    EDGE, RoutedExpertsRef, checksum_hex, fetch)

def used_mib():
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bavail) * st.f_frsize >> 20

conn = HostTransportConnector(HostTransportConfig(scope="pin"))
out = {"start": used_mib()}
refs, want = [], []
for i in range(4):
    rows = np.full(((16 << 20) // 384, 48, 8), i, np.uint8)
    key = secrets.token_hex(16)
    assert conn.put(EDGE[0], EDGE[1], key, rows)[0]
    refs.append(RoutedExpertsRef(transport="host", location=conn.scope_name,
        key=key, shape=rows.shape, dtype="uint8", nbytes=rows.nbytes,
        checksum=checksum_hex(rows.reshape(-1))))
    want.append(rows)
out["waiting"] = used_mib()
held = [fetch(r) for r in refs]  # the trainer keeps its batch
out["taken"] = len(conn.taken())
out["held"] = used_mib()
out["exact"] = all((h == w).all() for h, w in zip(held, want))
held[0][0, 0, 0] = 99  # writable
out["writable"] = True
del held
out["dropped"] = used_mib()
conn.close()
routed_experts.close()
print(json.dumps(out))
"""


def _run_in_small_shm(size: str, code: str) -> dict:
    r = subprocess.run(
        small_shm_argv(size, f"{sys.executable} -c {shlex.quote(code)}"),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_HOST_TRANSPORT_SCOPE": ""},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_fetched_arrays_do_not_pin_dev_shm():
    """r5 M6: once fetched, a payload's bytes leave ``/dev/shm`` while the
    trainer still holds the arrays (they are the trainer's own memory)."""
    skip_unless_private_shm()
    out = _run_in_small_shm("128m", PIN_CHILD)
    assert out["waiting"] - out["start"] >= 60, out  # 4 x 16 MiB waiting
    assert out["taken"] == 4 and out["exact"] is True, out
    # Held arrays: /dev/shm back to (about) where it started; the ring
    # (4 MiB, preallocated) and the stamp page may remain.
    assert out["held"] - out["start"] <= 5, out


def _ref_fields(**over) -> dict:
    fields = dict(
        transport="host",
        location="x",
        key="0" * 32,
        shape=(1, 1, 1),
        dtype="uint8",
        nbytes=1,
        checksum="0" * 16,
    )
    fields.update(over)
    return fields


@pytest.mark.parametrize(
    "fields",
    [
        _ref_fields(shape=(1, 2)),
        _ref_fields(transport="mooncake", location=5),
        _ref_fields(nbytes="1"),
        _ref_fields(shape=("1", 1, 1)),
        _ref_fields(prompt_start=None),
        _ref_fields(key=None),
    ],
    ids=[
        "2-d shape",
        "int location",
        "str nbytes",
        "str row",
        "None start",
        "None key",
    ],
)
def test_a_malformed_struct_is_a_typed_error(fields):
    """r5 L4: a ``RoutedExpertsRef`` built in code is not validated by
    msgspec; ``fetch`` still raises only ``RouteRefInvalidError``."""
    from vllm_host_transport.routed_experts import (
        RoutedExpertsRef,
        RouteRefInvalidError,
        fetch,
    )

    with pytest.raises(RouteRefInvalidError):
        fetch(RoutedExpertsRef(**fields))


def test_stale_locations_create_nothing_and_the_cache_is_bounded():
    """r5 L5: fetching references to scopes that do not exist (an engine
    long gone, another node's) creates no directory and keeps no connector;
    fetches from many live scopes keep a bounded number of connectors."""
    import glob
    import secrets
    import uuid

    import numpy as np

    from vllm_host_transport import HostTransportConfig, HostTransportConnector
    from vllm_host_transport import routed_experts as client
    from vllm_host_transport.routed_experts import (
        EDGE,
        RoutedExpertsRef,
        RouteRefMissingError,
        checksum_hex,
        fetch,
    )

    client.close()
    before = set(glob.glob(f"/dev/shm/vllm-ht-{os.getuid()}-*"))
    for i in range(5):
        ref = _ref_fields(location=f"gone-engine-{uuid.uuid4().hex}~{i:016x}")
        with pytest.raises(RouteRefMissingError):
            fetch(ref)
        with pytest.raises(RouteRefMissingError):
            fetch(_ref_fields(location=f"gone-engine-{uuid.uuid4().hex}"))
    assert set(glob.glob(f"/dev/shm/vllm-ht-{os.getuid()}-*")) == before
    assert len(client._connectors) == 0

    producers = [
        HostTransportConnector(HostTransportConfig(scope=f"many-{uuid.uuid4().hex}"))
        for _ in range(client.MAX_CONNECTORS + 4)
    ]
    try:
        rows = np.arange(48, dtype=np.uint8).reshape(2, 24, 1)
        for p in producers:
            key = secrets.token_hex(16)
            assert p.put(EDGE[0], EDGE[1], key, rows)[0]
            ref = RoutedExpertsRef(
                transport="host",
                location=p.scope_name,
                key=key,
                shape=rows.shape,
                dtype="uint8",
                nbytes=rows.nbytes,
                checksum=checksum_hex(rows.reshape(-1)),
            )
            assert (fetch(ref) == rows).all()
            assert len(client._connectors) <= client.MAX_CONNECTORS
    finally:
        client.close()
        for p in producers:
            p.close()
    assert set(glob.glob(f"/dev/shm/vllm-ht-{os.getuid()}-*")) == before
