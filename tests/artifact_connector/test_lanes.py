# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The shared tier's lanes (``mooncake/lanes.py``): a transfer that stalls
in one client is retried on the other within its deadline, and later ones
go there; the stuck client is used again once its call returns; with every
client stuck (a frozen master) calls fail at once; clients are opened with
the lanes and closed with them, by their own threads, never under a call.

Mooncake's stalled connection (its issue 4209) cannot be produced on
demand, so the "clients" here are plain objects and the stall is a call
held on an event (the real engine stall is in
``tests/test_r3_shared_kv.py::test_decode_engine_over_http``)."""

from __future__ import annotations

import threading
import time

import pytest

from vllm.distributed.artifact_connector.mooncake.lanes import LANES, Lanes
from vllm.distributed.artifact_connector.mooncake.remote import (
    SharedTierUnavailableError,
)

TIMEOUT_S = 1.0


class _Client:
    def __init__(self, n: int) -> None:
        self.n = n
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


class _Objects:
    """What a lane's calls get: its client's number."""

    def __init__(self, client: _Client) -> None:
        self.client = client

    def close(self) -> None:
        pass


@pytest.fixture
def lanes():
    clients: list[_Client] = []

    def open_client() -> _Client:
        clients.append(_Client(len(clients)))
        return clients[-1]

    lanes = Lanes("127.0.0.1:1", open_client, _Objects, TIMEOUT_S)
    assert len(clients) == LANES  # opened with the lanes, never later
    yield lanes, clients
    lanes.close()
    assert all(c.closed.is_set() for c in clients)


def _held(release: threading.Event, stall_on: set[int]):
    """A transfer that hangs on the clients in ``stall_on`` until
    ``release``; answers the client's number."""

    def fn(objects: _Objects) -> int:
        if objects.client.n in stall_on:
            release.wait(30)
        return objects.client.n

    return fn


def test_a_stalled_transfer_is_retried_on_the_other_client(lanes):
    lanes, clients = lanes
    release = threading.Event()
    try:
        t0 = time.monotonic()
        assert lanes.call(_held(release, {0}), TIMEOUT_S) == 1
        assert time.monotonic() - t0 < TIMEOUT_S + 0.5
        assert lanes.switched == 1
        # The other client serves what follows; the stuck one stays open
        # while its call is in it.
        assert lanes.call(_held(release, {0}), TIMEOUT_S) == 1
        assert not clients[0].closed.is_set()
    finally:
        release.set()
    # Once its call returned and its breaker's pause is over, the first
    # client serves again when the second one stalls.
    time.sleep(1.2)
    again = threading.Event()
    try:
        assert lanes.call(_held(again, {1}), TIMEOUT_S) == 0
    finally:
        again.set()
    assert lanes.switched == 2
    assert len(clients) == LANES


def test_every_client_stuck_fails_calls_at_once(lanes):
    lanes, clients = lanes
    release = threading.Event()
    stall_all = _held(release, set(range(LANES)))
    try:
        with pytest.raises(SharedTierUnavailableError):
            lanes.call(stall_all, TIMEOUT_S)
        t0 = time.monotonic()
        for _ in range(5):
            with pytest.raises(SharedTierUnavailableError):
                lanes.call(stall_all, TIMEOUT_S)
            assert not lanes.post(stall_all)
        assert time.monotonic() - t0 < 1.0  # the breaker answers, at once
    finally:
        release.set()
    # Once the stuck calls return, the tier is called again.
    deadline = time.monotonic() + 20
    while True:
        try:
            assert lanes.call(_held(release, set()), TIMEOUT_S) in (0, 1)
            break
        except SharedTierUnavailableError:
            assert time.monotonic() < deadline, "the lanes never recovered"
            time.sleep(0.2)


def test_a_mirror_behind_a_stuck_client_goes_to_the_other(lanes):
    lanes, clients = lanes
    release = threading.Event()
    done = threading.Event()
    ran_on: list[int] = []
    try:
        assert lanes.post(_held(release, {0}))
        time.sleep(TIMEOUT_S + 0.2)  # the first mirror is stuck past its budget

        def mirror(objects: _Objects) -> None:
            ran_on.append(objects.client.n)
            done.set()

        assert lanes.post(mirror)
        assert done.wait(10)
        assert ran_on == [1]
    finally:
        release.set()
