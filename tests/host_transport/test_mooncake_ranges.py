# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Range reads of references over a Mooncake Store
(``vllm_host_transport.mooncake_refs``), against a real ``mooncake_master``
on 127.0.0.1 (TCP): objects put by one client (the engine's, with a
segment) are read in byte ranges by other processes, many at once, equal to
what was put; a missing object, a size that differs, a master frozen after
the join fail typed (the last within ``timeout_s``, the caller's arrays
untouched); the driver's ``remove`` and the last of N readers' ``mark_read``
remove the object."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
from utils.mooncake import Master, Ticker, running_master

from vllm_host_transport import mooncake_clients, mooncake_refs
from vllm_host_transport.routed_experts import (
    RouteRefCorruptError,
    RouteRefInvalidError,
    RouteRefMissingError,
    RouteRefTransportError,
)

mooncake = pytest.importorskip(
    "mooncake.store", reason="Mooncake's client is installed by `make setup`"
)

OBJECTS = 16
OBJECT_NBYTES = 300_000 + 123  # not a multiple of anything


def payload(seed: int, nbytes: int = OBJECT_NBYTES) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class Engine:
    """An engine's client (it contributes the segment the objects live in)."""

    def __init__(self, address: str) -> None:
        self.store = mooncake.MooncakeDistributedStore()
        assert self.store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20,
                                "tcp", "", address) == 0  # fmt: skip
        self.prefix = secrets.token_hex(8)

    def put(self, seed: int, nbytes: int = OBJECT_NBYTES) -> str:
        key = f"{self.prefix}-{seed}"
        data = payload(seed, nbytes)
        half = nbytes // 2  # in two parts, as the engine's sink puts them
        assert self.store.put_parts(key, data[:half].data, data[half:].data) == 0
        return key

    def exists(self, keys: list[str]) -> list[int]:
        return self.store.batch_is_exist(keys)


@pytest.fixture(scope="module")
def master() -> Iterator[Master]:
    with running_master("mooncake-master-ranges") as m:
        yield m


@pytest.fixture(scope="module")
def engine(master: Master) -> Iterator[Engine]:
    e = Engine(master.address)
    yield e
    e.store.close()


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    mooncake_clients.close_clients()


def _ranges(seed: int) -> list[tuple[int, int]]:
    """(offset, size) pairs: the header-like start, ranges that touch,
    overlap, lie a little apart (read as one span) and far apart, the end."""
    rng = np.random.default_rng(seed)
    out = [(0, 64), (64, 4096), (5000, 1000), (5500, 2000), (40_000, 8192)]
    out += [(int(o), int(rng.integers(1, 20_000)))
            for o in rng.integers(0, OBJECT_NBYTES - 20_000, 6)]  # fmt: skip
    out.append((OBJECT_NBYTES - 777, 777))
    return out


# A trainer rank: joins the master (one read of the shared object), says
# so, then reads what stdin names (rounds of [key, seed, [[offset, size],
# ...]]), checks every byte against payload() (the same generator), prints
# when it read, and marks the shared object read.
READER = r"""
import json, sys, time
import numpy as np
from vllm_host_transport import mooncake_clients, mooncake_refs
master, shared = sys.argv[1:3]
reader, nbytes = map(int, sys.argv[3:5])
mooncake_refs.read_ranges(master, shared, 1000, [(0, np.zeros(8, np.uint8))], 30.0)
print("joined", flush=True)
plan = json.loads(sys.stdin.readline())
start = time.monotonic()
for rounds in plan:
    reads, want = [], []
    for key, seed, ranges in rounds:
        source = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        pairs = [(off, np.zeros(size, np.uint8)) for off, size in ranges]
        want += [(dst, source[off : off + dst.nbytes]) for off, dst in pairs]
        reads.append((key, nbytes, pairs))
    mooncake_refs.read_ranges_many(master, reads, 30.0)
    assert all(np.array_equal(a, b) for a, b in want), "bytes differ"
print(start, time.monotonic(), flush=True)
assert "vllm" not in sys.modules and "torch" not in sys.modules
print(mooncake_refs.mark_read(master, shared, reader, 8, 30.0), flush=True)
"""


def test_eight_readers_read_ranges_of_the_same_objects_at_once(master, engine):
    """Eight processes (vLLM and torch never imported), joined, each read
    5 x 16 objects in ranges at once (each while another reads); every byte
    equals what was put. Then each marks a shared object read: exactly one
    of them removes it."""
    keys = [engine.put(seed) for seed in range(OBJECTS)]
    shared = engine.put(OBJECTS, 1000)
    readers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                READER,
                master.address,
                shared,
                str(i),
                str(OBJECT_NBYTES),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for i in range(8)
    ]
    try:
        for p in readers:
            assert p.stdout is not None and p.stdout.readline() == b"joined\n"
        for i, p in enumerate(readers):
            plan = [
                [[key, seed, _ranges(1000 * i + 100 * r + seed)]
                 for seed, key in enumerate(keys)]
                for r in range(5)
            ]  # fmt: skip
            assert p.stdin is not None
            p.stdin.write(json.dumps(plan).encode() + b"\n")
            p.stdin.flush()
        outs = []
        for p in readers:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err.decode()[-3000:]
            outs.append(out.decode().split())
    finally:
        for p in readers:
            if p.poll() is None:
                p.kill()
                p.wait()
    spans = [(float(o[0]), float(o[1])) for o in outs]
    for i, (a, b) in enumerate(spans):
        assert any(c < b and a < d for j, (c, d) in enumerate(spans) if j != i)
    assert sorted(o[2] for o in outs) == ["False"] * 7 + ["True"], outs
    markers = [f"{shared}.read.{i}.8" for i in range(8)]
    assert engine.exists([shared, *markers]) == [0] * 9


def test_a_missing_object_is_typed_at_once_and_writes_nothing(master, engine):
    key = engine.put(1)
    dst = np.zeros(100, np.uint8)
    mooncake_refs.read_ranges(master.address, key, OBJECT_NBYTES, [(0, dst)], 5.0)
    assert np.array_equal(dst, payload(1)[:100])  # joined
    a, b = np.zeros(100, np.uint8), np.zeros(100, np.uint8)
    start = time.monotonic()
    with pytest.raises(RouteRefMissingError, match="not in the Mooncake Store"):
        mooncake_refs.read_ranges_many(
            master.address,
            [(key, OBJECT_NBYTES, [(0, a)]), ("0" * 32, OBJECT_NBYTES, [(0, b)])],
            5.0,
        )
    assert time.monotonic() - start < 0.5
    assert not a.any() and not b.any()


def test_a_size_that_differs_is_corrupt_and_a_bad_range_invalid(master, engine):
    key = engine.put(2)
    dst = np.zeros(10, np.uint8)
    with pytest.raises(RouteRefCorruptError, match=f"holds {OBJECT_NBYTES} bytes"):
        mooncake_refs.read_ranges(
            master.address, key, OBJECT_NBYTES + 1, [(0, dst)], 5.0
        )
    with pytest.raises(RouteRefInvalidError, match="outside"):
        mooncake_refs.read_ranges(
            master.address, key, OBJECT_NBYTES, [(OBJECT_NBYTES - 5, dst)], 5.0
        )
    with pytest.raises(RouteRefInvalidError, match="uint8"):
        mooncake_refs.read_ranges(
            master.address, key, OBJECT_NBYTES, [(0, np.zeros(4, np.int32))], 5.0
        )
    assert not dst.any()


def test_remove_and_mark_read(master, engine):
    key = engine.put(3)
    dst = np.zeros(10, np.uint8)
    mooncake_refs.read_ranges(master.address, key, OBJECT_NBYTES, [(0, dst)], 5.0)
    # Right after a read (its lease holds the object): removed all the same.
    assert mooncake_refs.remove(master.address, key, 5.0) is True
    assert mooncake_refs.remove(master.address, key, 5.0) is False
    with pytest.raises(RouteRefMissingError):
        mooncake_refs.read_ranges(master.address, key, OBJECT_NBYTES, [(0, dst)], 5.0)
    # Three readers, in any order: the last one removes object and markers.
    key = engine.put(4)
    markers = [f"{key}.read.{i}.3" for i in range(3)]
    assert mooncake_refs.mark_read(master.address, key, 2, 3, 5.0) is False
    assert mooncake_refs.mark_read(master.address, key, 2, 3, 5.0) is False  # again
    assert mooncake_refs.mark_read(master.address, key, 0, 3, 5.0) is False
    assert engine.exists([key, *markers]) == [1, 1, 0, 1]
    assert mooncake_refs.mark_read(master.address, key, 1, 3, 5.0) is True
    assert engine.exists([key, *markers]) == [0, 0, 0, 0]
    # The object gone first (its TTL): the next reader to mark removes the
    # markers left.
    key = engine.put(5)
    markers = [f"{key}.read.{i}.2" for i in range(2)]
    assert mooncake_refs.mark_read(master.address, key, 0, 2, 5.0) is False
    assert engine.store.remove(key, True) == 0
    assert mooncake_refs.mark_read(master.address, key, 1, 2, 5.0) is False
    assert engine.exists(markers) == [0, 0]
    with pytest.raises(RouteRefInvalidError):
        mooncake_refs.mark_read(master.address, key, 2, 2, 5.0)


def test_a_master_frozen_after_the_join_fails_within_timeout(master, engine):
    """Reads and removals on a joined client give up at ``timeout_s`` while
    the master is frozen (Mooncake's calls would wait until it resumes), the
    process's other threads run meanwhile, the destination stays untouched,
    and once the master answers the same client reads again."""
    key = engine.put(6)
    dst = np.zeros(1000, np.uint8)
    mooncake_refs.read_ranges(master.address, key, OBJECT_NBYTES, [(0, dst)], 5.0)
    dst[:] = 0
    ticker = Ticker()
    try:
        master.freeze(resume_after_s=30.0)
        for call in (
            lambda: mooncake_refs.read_ranges(
                master.address, key, OBJECT_NBYTES, [(0, dst)], 1.0
            ),
            # Other keys: these calls go through once the master resumes.
            lambda: mooncake_refs.remove(master.address, "0" * 32, 1.0),
            lambda: mooncake_refs.mark_read(master.address, "1" * 32, 0, 2, 1.0),
        ):
            start = time.monotonic()
            with pytest.raises(RouteRefTransportError, match="did not answer"):
                call()
            end = time.monotonic()
            assert 1.0 <= end - start < 2.5
            assert ticker.ticked_between(start + 0.25, end - 0.25)
        assert master.still_frozen()
        assert not dst.any()
        master.thaw()
        mooncake_refs.read_ranges(master.address, key, OBJECT_NBYTES, [(0, dst)], 5.0)
        assert np.array_equal(dst, payload(6)[:1000])
    finally:
        ticker.stop()
        master.thaw()
