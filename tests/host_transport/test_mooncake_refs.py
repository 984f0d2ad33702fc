# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A trainer's reads of references over a Mooncake Store never freeze its
process: with a real ``mooncake_master`` frozen (``SIGSTOP``) before the
process's first ``fetch``, the fetch fails with ``RouteRefTransportError``
while the master is still frozen (it joins only a master that answered a
probe in a child process), and a thread of the process keeps running
through it. Mooncake's ``setup`` would hold the interpreter lock until the
master resumes (another process resumes it after 30 s)."""

from __future__ import annotations

import secrets
import time

import numpy as np
import pytest
from utils.mooncake import Ticker, running_master

from vllm_host_transport import mooncake_refs
from vllm_host_transport.routed_experts import (
    RoutedExpertsRef,
    RouteRefTransportError,
    checksum_hex,
    fetch,
)

mooncake = pytest.importorskip(
    "mooncake.store", reason="Mooncake's client is installed by `make setup`"
)

FREEZE_S = 30.0


def _engine_put(address: str):
    """An engine's client and one payload in the store, with its ref."""
    store = mooncake.MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                       address) == 0  # fmt: skip
    rows = np.full((100, 4, 2), 3, np.uint8)
    key = secrets.token_hex(16)
    assert store.put(key, rows.reshape(-1).data) == 0
    ref = RoutedExpertsRef(transport="mooncake", location=address, key=key,
                           shape=rows.shape, dtype="uint8", nbytes=rows.nbytes,
                           checksum=checksum_hex(rows.reshape(-1)))  # fmt: skip
    return store, ref, rows


def test_a_first_fetch_from_a_frozen_master_fails_and_freezes_nothing():
    with running_master("mooncake-master-trainer-frozen") as master:
        store, ref, rows = _engine_put(master.address)
        ticker = Ticker()
        try:
            master.freeze(resume_after_s=FREEZE_S)
            start = time.monotonic()
            with pytest.raises(RouteRefTransportError, match="did not answer"):
                fetch(ref, timeout_s=1.0)
            end = time.monotonic()
            # It ended while the master was still frozen (not when it resumed).
            assert master.still_frozen()
            # The process's other threads ran while it waited.
            quarter = (end - start) / 4
            assert ticker.ticked_between(start + quarter, end - quarter)
            master.thaw()
            # Once the master answers, the next fetch joins and reads.
            np.testing.assert_array_equal(fetch(ref, timeout_s=5.0), rows)
        finally:
            ticker.stop()
            master.thaw()
            mooncake_refs.close_clients()
            store.close()
