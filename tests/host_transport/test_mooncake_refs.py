# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A trainer's reads of references over a Mooncake Store never freeze its
process: with a real ``mooncake_master`` frozen (``SIGSTOP``) before the
process's first read, the read fails with ``RouteRefTransportError`` while
the master is still frozen (it joins only a master that answered a probe in
a child process), and a thread of the process keeps running through it.
Mooncake's ``setup`` would hold the interpreter lock until the master
resumes (another process resumes it after 30 s). Reads on a client that
joined already: ``test_mooncake_ranges.py``."""

from __future__ import annotations

import secrets
import time

import numpy as np
import pytest
from utils.mooncake import Ticker, running_master

from vllm_host_transport import mooncake_clients, mooncake_refs
from vllm_host_transport.routed_experts import RouteRefTransportError

mooncake = pytest.importorskip(
    "mooncake.store", reason="Mooncake's client is installed by `make setup`"
)

FREEZE_S = 30.0


def _engine_put(address: str):
    """An engine's client and one payload in the store, with its key."""
    store = mooncake.MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                       address) == 0  # fmt: skip
    data = np.full(800, 3, np.uint8)
    key = secrets.token_hex(16)
    assert store.put(key, data.data) == 0
    return store, key, data


def test_a_first_read_from_a_frozen_master_fails_and_freezes_nothing():
    with running_master("mooncake-master-trainer-frozen") as master:
        store, key, data = _engine_put(master.address)
        ticker = Ticker()
        dst = np.zeros(data.nbytes, np.uint8)
        try:
            master.freeze(resume_after_s=FREEZE_S)
            start = time.monotonic()
            with pytest.raises(RouteRefTransportError, match="did not answer"):
                mooncake_refs.read_ranges(
                    master.address, key, data.nbytes, [(0, dst)], timeout_s=1.0
                )
            end = time.monotonic()
            # It ended while the master was still frozen (not when it resumed).
            assert master.still_frozen()
            # The process's other threads ran while it waited.
            quarter = (end - start) / 4
            assert ticker.ticked_between(start + quarter, end - quarter)
            master.thaw()
            # Once the master answers, the next read joins and reads.
            mooncake_refs.read_ranges(
                master.address, key, data.nbytes, [(0, dst)], timeout_s=5.0
            )
            np.testing.assert_array_equal(dst, data)
        finally:
            ticker.stop()
            master.thaw()
            mooncake_clients.close_clients()
            store.close()
