# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``routed_experts.fetch`` on the host transport: what a fetched array
costs ``/dev/shm``, what malformed references raise, and what fetches of
stale locations leave behind. Real producers and the real ``/dev/shm`` (a
private small tmpfs where free space is measured)."""

from __future__ import annotations

import json
import os

import pytest
from utils.shm_ns import run_python_in_small_shm, skip_unless_private_shm

PIN_CHILD = r"""
import json, os, secrets
import numpy as np
from vllm_host_transport import HostTransportConfig, HostTransportConnector
from vllm_host_transport import routed_experts, routes_format
from vllm_host_transport.routed_experts import RoutedExpertsRef, fetch
from vllm_host_transport.routes_reader import release

def used_mib():
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bavail) * st.f_frsize >> 20

conn = HostTransportConnector(HostTransportConfig(scope="pin"))
out = {"start": used_mib()}
refs, want = [], []
for i in range(4):
    rows = np.full(((16 << 20) // 384, 48, 8), i, np.uint8)
    payload = routes_format.encode(rows)
    key = secrets.token_hex(16)
    assert conn.put_readable(key, payload.parts)
    refs.append(RoutedExpertsRef.for_payload(
        payload, transport="host", location=conn.scope_name, key=key))
    want.append(rows)
out["waiting"] = used_mib()
held = [fetch(r) for r in refs]  # the trainer keeps its batch
again = [fetch(r) for r in refs]  # another rank reads the same payloads
out["read"] = used_mib()  # read-many: the payloads stay until released
out["exact"] = all((h == w).all() and (a == w).all()
                   for h, a, w in zip(held, again, want))
out["released"] = release(refs)
out["held"] = used_mib()
out["still_exact"] = all((h == w).all() for h, w in zip(held, want))
held[0][0, 0, 0] = 99  # writable, and not the other rank's array
out["own"] = bool(again[0][0, 0, 0] == 0)
del held, again
conn.close()
routed_experts.close()
print(json.dumps(out))
"""


def test_fetched_arrays_do_not_pin_dev_shm():
    """r5 M6: a fetched array is the trainer's own memory: once its payload
    is released, the payload's bytes leave ``/dev/shm`` while the trainer
    still holds the arrays (the reader copies the ranges out; nothing
    stays mapped)."""
    skip_unless_private_shm()
    r = run_python_in_small_shm("128m", PIN_CHILD)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["waiting"] - out["start"] >= 60, out  # 4 x 16 MiB waiting
    assert out["read"] - out["start"] >= 60, out  # reading removes nothing
    assert out["exact"] is True and out["released"] == 4, out
    # Held arrays, payloads released: /dev/shm back to (about) where it
    # started (the producer's registration and the scope remain).
    assert out["held"] - out["start"] <= 2, out
    assert out["still_exact"] is True and out["own"] is True, out


def _ref_fields(**over) -> dict:
    """A well-formed reference's fields (nothing stored behind it), with
    ``over`` replaced."""
    from vllm_host_transport.routes_format import FORMAT

    fields = dict(
        transport="host",
        location="x",
        key="0" * 32,
        shape=(1, 1, 1),
        dtype="uint8",
        nbytes=1,
        checksum="0" * 16,
        format=FORMAT,
        header_nbytes=64,
        block_rows=1024,
    )
    fields.update(over)
    return fields


def test_the_base_reference_is_well_formed():
    """What the malformed cases below change is the only fault in them."""
    from vllm_host_transport.routed_experts import RoutedExpertsRef, as_ref

    ref = as_ref(RoutedExpertsRef(**_ref_fields()))
    assert ref == RoutedExpertsRef(**_ref_fields())


@pytest.mark.parametrize(
    "fields",
    [
        _ref_fields(shape=(1, 2)),
        _ref_fields(transport="mooncake", location=5),
        _ref_fields(nbytes="1"),
        _ref_fields(shape=("1", 1, 1)),
        _ref_fields(prompt_start=None),
        _ref_fields(key=None),
        _ref_fields(header_nbytes=100),
        _ref_fields(block_rows=0),
        _ref_fields(transport="mooncake", location="127.0.0.1:1"),
    ],
    ids=[
        "2-d shape",
        "int location",
        "str nbytes",
        "str row",
        "None start",
        "None key",
        "unaligned header",
        "no block rows",
        "Mooncake without sha256",
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


def test_a_take_once_reference_is_refused_naming_the_release():
    """A reference of an engine before read-many references (stored form
    1, a whole array taken once) is refused, typed, saying why."""
    from vllm_host_transport.routed_experts import RouteRefInvalidError, fetch

    with pytest.raises(RouteRefInvalidError, match="stored form 1"):
        fetch(_ref_fields(format=1))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_stale_locations_create_nothing_and_fetch_holds_nothing():
    """r5 L5: fetching references to scopes that do not exist (an engine
    long gone, another node's) creates no directory and answers at once.
    A fetch keeps nothing between calls (no connector, no descriptor), so
    fetches from many live scopes leave nothing open and every scope goes
    with its producer."""
    import glob
    import secrets
    import time
    import uuid

    import numpy as np

    from vllm_host_transport import HostTransportConfig, HostTransportConnector
    from vllm_host_transport import routed_experts as client
    from vllm_host_transport.routed_experts import (
        RoutedExpertsRef,
        RouteRefMissingError,
        fetch,
    )
    from vllm_host_transport.routes_format import encode

    client.close()
    before = set(glob.glob(f"/dev/shm/vllm-ht-{os.getuid()}-*"))
    fds = _open_fds()
    for i in range(5):
        for location in (
            f"gone-engine-{uuid.uuid4().hex}~{i:016x}",
            f"gone-engine-{uuid.uuid4().hex}",
        ):
            t0 = time.monotonic()
            with pytest.raises(RouteRefMissingError):
                fetch(_ref_fields(location=location))
            assert time.monotonic() - t0 < 0.5
    assert set(glob.glob(f"/dev/shm/vllm-ht-{os.getuid()}-*")) == before
    assert _open_fds() == fds

    producers = [
        HostTransportConnector(HostTransportConfig(scope=f"many-{uuid.uuid4().hex}"))
        for _ in range(20)
    ]
    try:
        rows = np.arange(48, dtype=np.uint8).reshape(2, 24, 1)
        payload = encode(rows)
        refs = []
        for p in producers:
            key = secrets.token_hex(16)
            assert p.put_readable(key, payload.parts)
            refs.append(
                RoutedExpertsRef.for_payload(
                    payload, transport="host", location=p.scope_name, key=key
                )
            )
        fds = _open_fds()
        for ref in refs:
            assert (fetch(ref) == rows).all()
        assert _open_fds() == fds
    finally:
        client.close()
        for p in producers:
            p.close()
    assert set(glob.glob(f"/dev/shm/vllm-ht-{os.getuid()}-*")) == before
