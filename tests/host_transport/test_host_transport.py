# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Behaviour tests of the host transport (spec: shared/specs/host-transport.md)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import threading
import time

import msgspec
import numpy as np
import pytest
import torch

from vllm_host_transport import (
    HostTransportConfig,
    HostTransportConnector,
    HostTransportError,
    discovery,
    perkey,
)
from vllm_host_transport import frame as framemod
from vllm_host_transport import ring as ringmod
from vllm_host_transport import ring_view as viewmod

from . import helpers
from .conftest import TINY_RING, scope_path

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]


def _sample(dtype: torch.dtype, shape=(4, 6)) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -100), min(info.max, 100), shape, dtype=dtype)


def roundtrip(c: HostTransportConnector, data, key: str = "k"):
    ok, size, desc = c.put("p", "c", key, data)
    assert ok and size > 0 and desc is not None
    r = c.get("p", "c", key)
    assert r is not None
    return r[0]


def _assert_not_shm(t: torch.Tensor) -> None:
    # Owned memory: writable and still valid after every mapping is gone.
    t.view(-1)[:0]  # noqa: B018
    assert t.untyped_storage().data_ptr() != 0


# --------------------------------------------------------------- tensor frames
def test_every_dtype_noncontiguous_nested_owned(make_conn, ring_bytes):
    c = make_conn(ring_bytes)
    tree = {}
    for i, dt in enumerate(DTYPES):
        base = _sample(dt, (6, 4))
        tree[str(dt)] = {"nc": base.t(), "slice": [base[::2, 1:]], "i": i}
    tree["conj"] = torch.randn(3, 3, dtype=torch.complex64).conj()
    tree["neg"] = torch._neg_view(torch.randn(5))
    tree["nested"] = ({"deep": [torch.arange(5), (torch.ones(2),)]},)
    out = roundtrip(c, tree)
    for dt in DTYPES:
        src = tree[str(dt)]
        got = out[str(dt)]
        assert got["nc"].dtype == dt and torch.equal(got["nc"], src["nc"])
        assert torch.equal(got["slice"][0], src["slice"][0])
        assert got["i"] == src["i"]
        _assert_not_shm(got["nc"])
    assert torch.equal(out["conj"], tree["conj"].resolve_conj())
    assert torch.equal(out["neg"], tree["neg"].resolve_neg())
    assert torch.equal(out["nested"][0]["deep"][1][0], torch.ones(2))
    assert isinstance(out["nested"], list)  # tuples arrive as lists
    c.close()
    # Everything is still readable, and equal, once the connector (and its
    # mappings) are gone. Compare exactly: a sum would depend on the order of
    # summation, which differs between the transposed source and the
    # contiguous copy.
    for dt in DTYPES:
        assert torch.equal(out[str(dt)]["nc"], tree[str(dt)]["nc"])
        assert torch.equal(out[str(dt)]["slice"][0], tree[str(dt)]["slice"][0])


def test_zero_dim_and_empty_tensors(make_conn, ring_bytes):
    c = make_conn(ring_bytes)
    tree = {
        "scalar": torch.tensor(3.5),
        "bf16_scalar": torch.tensor(1.25, dtype=torch.bfloat16),
        "empty": torch.empty(0, 7),
        "empty_bool": torch.zeros(3, 0, dtype=torch.bool),
        "np_empty": np.zeros((0,), dtype=np.int32),
    }
    out = roundtrip(c, tree)
    assert out["scalar"].shape == () and out["scalar"].item() == 3.5
    assert out["bf16_scalar"].dtype == torch.bfloat16
    assert out["empty"].shape == (0, 7)
    assert out["empty_bool"].shape == (3, 0) and out["empty_bool"].dtype == torch.bool
    assert out["np_empty"].shape == (0,)


def test_source_overwritten_after_put(make_conn, ring_bytes):
    c = make_conn(ring_bytes)
    src = torch.arange(64, dtype=torch.int64)
    arr = np.arange(16, dtype=np.float32)
    c.put("p", "c", "k", {"t": src, "a": arr})
    src.fill_(-1)
    arr[:] = -1
    r = c.get("p", "c", "k")
    assert r is not None
    assert torch.equal(r[0]["t"], torch.arange(64))
    assert np.array_equal(r[0]["a"], np.arange(16, dtype=np.float32))


class Meta(msgspec.Struct, omit_defaults=True):
    name: str
    step: int = 7
    tags: list[str] = msgspec.field(default_factory=lambda: ["a"])
    weights: torch.Tensor | None = None


def test_typed_struct_keeps_omitted_defaults(make_conn, ring_bytes):
    c = make_conn(ring_bytes, allowed_struct_types=(Meta,))
    out = roundtrip(c, {"m": Meta(name="x", weights=torch.ones(3)), "n": Meta("y")})
    assert isinstance(out["m"], Meta) and out["m"].step == 7
    assert out["m"].tags == ["a"] and torch.equal(out["m"].weights, torch.ones(3))
    assert out["n"] == Meta("y")


def test_numpy_and_images_mixed_with_tensors(make_conn, ring_bytes):
    from PIL import Image

    c = make_conn(ring_bytes)
    img = Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3))
    arr = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2]
    data = {"img": img, "arr": arr, "t": torch.arange(3), "tup": (1, 2)}
    out = roundtrip(c, data)
    assert isinstance(out["img"], Image.Image)
    assert np.array_equal(np.asarray(out["img"]), np.asarray(img))
    assert np.array_equal(out["arr"], arr) and not out["arr"].flags.writeable
    assert torch.equal(out["t"], torch.arange(3))
    assert out["tup"] == [1, 2]
    assert c.health()["serializer_fallbacks"] == 1
    # The tensor-frame path gives read-only numpy arrays too.
    out2 = roundtrip(c, {"arr": arr}, key="k2")
    assert not out2["arr"].flags.writeable


def test_oversized_array_rejected_without_snapshot(make_conn, monkeypatch):
    c = make_conn(TINY_RING, max_payload_bytes=1024)
    big = torch.zeros(64, 64).t()  # non-contiguous: a snapshot would copy
    copies = []
    orig = torch.Tensor.contiguous

    def spy(self, *a, **k):
        copies.append(self.shape)
        return orig(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "contiguous", spy)
    monkeypatch.setattr(np, "ascontiguousarray", lambda *a, **k: copies.append(1))
    assert c.put("p", "c", "k", {"t": big}) == (False, 0, None)
    assert c.put("p", "c", "k2", np.zeros((64, 64)).T) == (False, 0, None)
    assert copies == []
    assert c.health()["put_failures"] == 2
    assert c.get("p", "c", "k") is None


def test_large_and_small_leaves_do_not_share_owner(make_conn):
    c = make_conn(0)  # large leaves exceed the tiny ring anyway
    big = torch.randn(256, 256)  # 256 KiB >= large_leaf_bytes
    out = roundtrip(c, {"a": torch.ones(4), "b": torch.zeros(3), "big": big})
    sa = out["a"].untyped_storage().data_ptr()
    sb = out["b"].untyped_storage().data_ptr()
    sbig = out["big"].untyped_storage().data_ptr()
    assert abs(sa - sb) < 1024  # small leaves share one owned buffer
    assert min(abs(sbig - sa), abs(sbig - sb)) >= 1024
    assert out["big"].untyped_storage().nbytes() == big.numel() * 4
    assert torch.equal(out["big"], big)


def test_borrowed_array_maps_the_claimed_segment(make_conn):
    """``get(borrow=True)``: a large array from a per-key segment is a view
    of the claimed segment's private mapping (no copy), writable without
    touching anything shared; the segment is gone once claimed; small
    leaves and ring payloads are copies as always."""
    c = make_conn(TINY_RING)
    big = np.arange(1 << 20, dtype=np.int32).reshape(1024, 1024)  # 4 MiB
    ok, _, _ = c.put("p", "c", "big", {"big": big, "small": np.arange(4)})
    assert ok
    segs = [n for n in os.listdir(c.scope_dir) if n.endswith(".seg")]
    assert len(segs) == 1
    out, _ = c.get("p", "c", "big", borrow=True)
    assert not [n for n in os.listdir(c.scope_dir) if n.endswith(".seg")]
    np.testing.assert_array_equal(out["big"], big)
    base = out["big"]
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview)  # the mapping, not an owned copy
    out["big"][0, 0] = -1  # private: writable, nothing shared changes
    np.testing.assert_array_equal(out["small"], np.arange(4))
    assert c.get("p", "c", "big", borrow=True) is None  # taken once
    ok, _, _ = c.put("p", "c", "tiny", np.arange(8))  # fits the ring
    got, _ = c.get("p", "c", "tiny", borrow=True)
    np.testing.assert_array_equal(got, np.arange(8))


# ------------------------------------------------------------------ the ring
def test_ring_full_and_large_frame_fall_back_then_ring_reused(make_conn):
    c = make_conn(TINY_RING)
    h = c.health
    # Larger than a quarter of the ring: per-key path.
    ok, _, desc = c.put("p", "c", "big", torch.zeros(512))
    assert ok and desc["plane"] == "key" and h()["fallback_too_large"] == 1
    # Fill the ring with small frames until one falls back for pressure.
    planes = []
    for i in range(12):
        planes.append(c.put("p", "c", f"s{i}", torch.full((40,), i))[2]["plane"])
    assert "ring" in planes and planes[-1] == "key"
    assert h()["fallback_ring_full"] >= 1
    for i in range(12):
        r = c.get("p", "c", f"s{i}")
        assert r is not None and torch.equal(r[0], torch.full((40,), i))
    assert c.get("p", "c", "big") is not None
    # Drained: the ring takes frames again.
    assert c.put("p", "c", "again", torch.ones(8))[2]["plane"] == "ring"
    assert h()["ring_puts"] > 0 and h()["fallbacks"] >= 2


def test_reput_across_ring_and_fallback(make_conn):
    c = make_conn(TINY_RING)
    c.put("p", "c", "k", "v1")  # ring
    ok, _, d2 = c.put("p", "c", "k", "v2" * 1000)  # per-key (too large)
    assert d2["plane"] == "key"
    r = c.get("p", "c", "k")
    assert r is not None and r[0] == "v2" * 1000
    assert c.get("p", "c", "k") is None  # v1 was retired
    c.put("p", "c", "j", "x" * 2000)  # per-key
    c.put("p", "c", "j", "small")  # ring; the segment is retired
    assert c.get("p", "c", "j")[0] == "small"
    assert c.get("p", "c", "j") is None
    assert c.health()["retired"] == 2


def test_stale_descriptor_after_wraparound(make_conn):
    c = make_conn(TINY_RING)
    _, _, d_old = c.put("p", "c", "k0", "old")
    assert c.get("p", "c", "k0")[0] == "old"
    # Wrap the ring several times so the old position's slot is reused.
    for i in range(40):
        c.put("p", "c", f"w{i}", f"w{i}")
        assert c.get("p", "c", f"w{i}")[0] == f"w{i}"
    _, _, d_new = c.put("p", "c", "k1", "new")
    assert d_new["pos"] > TINY_RING and d_new["pos"] % TINY_RING != d_new["pos"]
    forged = dict(d_old, pos=d_new["pos"] - TINY_RING * 2)
    assert c.get("p", "c", "k0", descriptor=d_old) is None
    assert c.get("p", "c", "k0", descriptor=forged) is None
    assert c.get("p", "c", "k1", descriptor=d_new)[0] == "new"


def test_exact_prefix_cancellation_returns_ring_credit(make_conn):
    c = make_conn(TINY_RING)
    for k in ("req_0_1", "req_0_2", "req_0_10x", "request_0_1", "req_0_"):
        assert c.put("p", "c", k, k)[0]
    used = c.health()["ring_bytes_in_use"]
    assert c.cleanup_prefix("req_0_") == 2
    assert c.health()["ring_bytes_in_use"] < used
    assert c.get("p", "c", "req_0_1") is None
    for k in ("req_0_10x", "request_0_1", "req_0_"):
        assert c.get("p", "c", k)[0] == k
    assert c.cleanup("req_0_1") is False


def test_cleanup_reports_unclaimed(make_conn, ring_bytes):
    c = make_conn(ring_bytes)
    c.put("p", "c", "a", 1)
    c.put("p", "c", "b", 2)
    assert c.get("p", "c", "b")[0] == 2
    assert c.cleanup("a") is True
    assert c.cleanup("b") is False
    assert c.cleanup("zzz") is False
    assert c.get("p", "c", "a") is None


# ------------------------------------------------------------- discovery
def test_explicit_scope_independent_of_parent(scope, make_conn):
    done, exit_ev = helpers.CTX.Event(), helpers.CTX.Event()

    def body():
        os.setsid()  # a different session: a derived scope would differ
        helpers.put_and_linger(scope, TINY_RING, [("k", "from-child")], done, exit_ev)

    p = helpers.CTX.Process(target=body)
    p.start()
    try:
        assert done.wait(30)
        c = make_conn(0)
        r = c.get_with_deadline("p", "c", "k", deadline=time.monotonic() + 10)
        assert r is not None and r[0] == "from-child"
    finally:
        exit_ev.set()
        p.join(30)
    assert (
        HostTransportConfig(scope=None)
        .resolved_scope()
        .startswith(("sid-", os.environ.get("VLLM_HOST_TRANSPORT_SCOPE") or "sid-"))
    )


def test_empty_polling_takes_no_lock_and_scans_nothing(make_conn, monkeypatch):
    prod = make_conn(TINY_RING)
    prod.put("p", "c", "other", 1)
    c = make_conn(TINY_RING)
    assert c.get("p", "c", "missing") is None  # first miss does the work
    calls = []
    # ring_view.py claims through its own alias of fcntl.flock: spy on both.
    spied = ((viewmod, "_flock"), (fcntl, "flock"), (os, "listdir"), (os, "open"))
    for mod, name in spied:
        orig = getattr(mod, name)

        def spy(*a, _orig=orig, _n=name, **k):
            calls.append(_n)
            return _orig(*a, **k)

        monkeypatch.setattr(mod, name, spy)
    for _ in range(100):
        assert c.get("p", "c", "missing") is None
    assert calls == []
    # The spies do see a real claim (the ring lock), so the silence above is
    # the fast path's, not blind spies'.
    prod.put("p", "c", "missing", 2)
    assert c.get("p", "c", "missing")[0] == 2
    assert "_flock" in calls or "flock" in calls
    monkeypatch.undo()


def test_new_producer_found_after_miss_with_frozen_clock(make_conn, monkeypatch):
    monkeypatch.setattr(discovery.time, "time_ns", lambda: 1_000)
    c = make_conn(TINY_RING)
    assert c.get("p", "c", "k") is None
    stamp = c._shared.scope.read_stamp()
    prod = make_conn(TINY_RING)
    prod.put("p", "c", "k", "hello")
    assert c._shared.scope.read_stamp() > stamp
    assert c.get("p", "c", "k")[0] == "hello"


def test_one_receiver_two_input_edges(make_conn, ring_bytes):
    a, b, r = make_conn(ring_bytes), make_conn(ring_bytes), make_conn(ring_bytes)
    a.put("A", "R", "k", "from-a")
    b.put("B", "R", "k", "from-b")
    assert r.get("B", "R", "k")[0] == "from-b"
    assert r.get("A", "R", "k")[0] == "from-a"
    assert r.get("A", "R", "k") is None


def test_discovery_attaches_every_producer(scope, make_conn):
    n = 3
    done = [helpers.CTX.Event() for _ in range(n)]
    exit_ev = helpers.CTX.Event()
    procs = [
        helpers.CTX.Process(
            target=helpers.put_and_linger,
            args=(scope, TINY_RING, [(f"k{i}", i)], done[i], exit_ev),
        )
        for i in range(n)
    ]
    for p in procs:
        p.start()
    try:
        for d in done:
            assert d.wait(30)
        c = make_conn(0)
        for i in range(n):
            assert c.get("p", "c", f"k{i}") == (i, c._receiver._codec.last_size)
        assert c.health()["rings_mapped"] == n
    finally:
        exit_ev.set()
        for p in procs:
            p.join(30)


def test_closed_producer_ring_released_by_receivers(make_conn):
    prod, c = make_conn(TINY_RING), make_conn(TINY_RING)
    prod.put("p", "c", "a", 1)
    assert c.get("p", "c", "a")[0] == 1
    assert c.health()["rings_mapped"] == 1
    prod.close()
    assert c.get("p", "c", "b") is None
    assert c.health()["rings_mapped"] == 0
    assert c.health()["rings_released"] == 1


def test_disabled_ring_and_unsupported_trees_use_plain_serializer(make_conn):
    c = make_conn(0)
    ok, _, desc = c.put("p", "c", "k", {"t": torch.ones(2)})
    assert desc["plane"] == "key" and c.health()["ring_puts"] == 0
    assert c.health()["rings_owned"] == 0
    ext = msgspec.msgpack.Ext(5, b"user")
    out = roundtrip(c, {"e": ext, "s": slice(1, 3), "t": torch.ones(2)}, key="u")
    assert out["e"] == ext and out["s"] == [1, 3, None]
    assert c.health()["serializer_fallbacks"] == 1
    c2 = make_conn(TINY_RING)
    out = roundtrip(c2, {"e": ext, "t": torch.ones(2)}, key="v")
    assert out["e"] == ext
    assert c2.put("p", "c", "bad", object()) == (False, 0, None)


@pytest.mark.parametrize("value", [0, "", [], {}, None, False, b"", 0.0])
def test_falsy_payloads_roundtrip(make_conn, ring_bytes, value):
    c = make_conn(ring_bytes)
    ok, _, _ = c.put("p", "c", "k", value)
    assert ok
    r = c.get("p", "c", "k")
    assert r is not None and r[0] == value and type(r[0]) is type(value)


# ----------------------------------------------------------- processes
def test_deadline_receive_not_blocked_by_ring_lock_holder(make_conn):
    prod, c = make_conn(TINY_RING), make_conn(TINY_RING)
    _, _, desc = prod.put("p", "c", "k", "v")
    held, release = helpers.CTX.Event(), helpers.CTX.Event()
    p = helpers.CTX.Process(
        target=helpers.hold_ring_lock,
        args=(prod.scope_dir, desc["ring"], held, release),
    )
    p.start()
    try:
        assert held.wait(30)
        assert (
            c.get_with_deadline("p", "c", "k", deadline=time.monotonic() + 0.2) is None
        )
        assert c.get_with_deadline("p", "c", "k", deadline=time.monotonic() - 1) is None
    finally:
        release.set()
        p.join(30)
    r = c.get_with_deadline("p", "c", "k", deadline=time.monotonic() + 10)
    assert r is not None and r[0] == "v"


def test_two_receiver_processes_claim_exactly_once(make_conn, ring_bytes):
    prod = make_conn(ring_bytes)
    keys = [f"k{i}" for i in range(40)]
    for k in keys:
        assert prod.put("p", "c", k, {"k": k})[0]
    counter = helpers.CTX.Value("i", 0)
    out = helpers.CTX.Queue()
    start = helpers.CTX.Event()
    procs = [
        helpers.CTX.Process(
            target=helpers.compete, args=(prod.config.scope, keys, counter, out, start)
        )
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    start.set()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    claimed = got[0] + got[1]
    assert sorted(claimed) == sorted(keys)  # each exactly once


def test_dead_producer_payload_never_reaches_reused_key(scope, make_conn, ring_bytes):
    p = helpers.CTX.Process(
        target=helpers.put_then_die, args=(scope, ring_bytes, "k", "stale")
    )
    p.start()
    p.join(30)
    c = make_conn(TINY_RING)
    assert c.get("p", "c", "k") is None
    # Removed when the receiver joined the scope (the producer was dead).
    assert c.health()["dead_producers_swept"] == 1
    fresh = make_conn(ring_bytes)
    fresh.put("p", "c", "k", "fresh")
    assert c.get("p", "c", "k")[0] == "fresh"
    assert c.get("p", "c", "k") is None
    # The dead producer's registration was pruned.
    assert not [n for n in os.listdir(c.scope_dir) if str(p.pid) in n]


def test_producer_killed_mid_publication_never_exposes_frame(
    scope, make_conn, ring_bytes
):
    p = helpers.CTX.Process(
        target=helpers.die_mid_publication, args=(scope, ring_bytes, "k")
    )
    p.start()
    p.join(30)
    assert p.exitcode == 0
    c = make_conn(TINY_RING)
    assert c.get("p", "c", "k") is None
    assert c.health()["corrupt_frames"] == 0


# ------------------------------------------------------------- failures
def test_setup_failure_enospc_falls_back(make_conn, monkeypatch, caplog):
    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    c = make_conn(TINY_RING)
    monkeypatch.setattr(ringmod.os, "posix_fallocate", no_space)
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            assert c.put("p", "c", f"k{i}", i)[2]["plane"] == "key"
    warnings = [r for r in caplog.records if "ring setup failed" in r.getMessage()]
    assert len(warnings) == 1  # once per edge
    monkeypatch.undo()
    assert [c.get("p", "c", f"k{i}")[0] for i in range(3)] == [0, 1, 2]
    assert not [n for n in os.listdir(c.scope_dir) if "ring" in n]


def test_stamp_failure_falls_back(make_conn, monkeypatch):
    c = make_conn(TINY_RING)
    r = make_conn(TINY_RING)
    assert r.get("p", "c", "k") is None

    def broken(self):
        raise OSError(errno.EIO, "stamp write failed")

    monkeypatch.setattr(discovery.ScopeDir, "advance_stamp", broken)
    assert c.put("p", "c", "k", "v")[2]["plane"] == "key"
    assert c.health()["fallback_ring_unavailable"] == 1
    assert not [n for n in os.listdir(c.scope_dir) if n.startswith("ring-")]
    assert r.get("p", "c", "k")[0] == "v"


def test_close_idempotent_removes_ring_and_safe_after_failed_ctor(
    make_conn, monkeypatch
):
    other = make_conn(TINY_RING)  # keeps the scope directory in use
    c = make_conn(TINY_RING)
    c.put("p", "c", "k", 1)
    assert [n for n in os.listdir(c.scope_dir) if n.startswith("ring-")]
    path = c.scope_dir
    c.close()
    c.close()
    assert not [n for n in os.listdir(path) if n.startswith("ring-")]
    other.close()
    assert c.put("p", "c", "k", 1) == (False, 0, None)
    with pytest.raises(HostTransportError):
        c.get("p", "c", "k")
    monkeypatch.setattr(discovery.sys, "platform", "darwin")
    with pytest.raises(HostTransportError, match="Linux"):
        HostTransportConnector(HostTransportConfig(scope="x"))
    bad = HostTransportConnector.__new__(HostTransportConnector)
    bad.close()  # never initialised at all
    with HostTransportConnector.__new__(HostTransportConnector):
        pass


def test_config_validation():
    HostTransportConfig(host_ring_bytes=0)
    HostTransportConfig(host_ring_bytes=64 << 20)
    for bad in (1024, (64 << 20) + 64, 4096 + 1):
        with pytest.raises(ValueError):
            HostTransportConfig(host_ring_bytes=bad)
    assert HostTransportConfig().host_ring_bytes == 4 << 20


# ------------------------------------------------------------- hardening
def test_corrupt_frame_is_none_plus_counter(make_conn, ring_bytes):
    prod, c = make_conn(ring_bytes), make_conn(TINY_RING)
    _, _, desc = prod.put("p", "c", "k", {"t": torch.ones(4)})
    if desc["plane"] == "ring":
        view = prod._sender._edges[("p", "c")].ring
        mv = view._mv
        off = ringmod.HEADER_SIZE + desc["pos"] + ringmod.FRAME_HDR
        mv[off : off + 4] = b"XXXX"  # frame magic
    else:
        seg = [n for n in os.listdir(prod.scope_dir) if n.endswith(".seg")][0]
        with open(os.path.join(prod.scope_dir, seg), "r+b") as f:
            f.seek(perkey.SEG_HEADER_SIZE)
            f.write(b"XXXX")
    assert c.get("p", "c", "k") is None
    assert c.health()["corrupt_frames"] == 1
    prod.put("p", "c", "k2", 5)
    assert c.get("p", "c", "k2")[0] == 5


@pytest.mark.parametrize(
    "field, value",
    [(4, 4096), (5, 7), (1, "no_such_dtype"), (2, [-1]), (3, 9), (0, 5)],
)
def test_corrupt_tensor_dict_header_is_none_plus_counter(make_conn, field, value):
    """A tensor-dict frame whose header names a region outside the frame, a
    size that does not match the shape, an unknown dtype, a negative dim, a
    bad area or a non-str key is refused (None plus a counter), not read."""
    prod, c = make_conn(TINY_RING), make_conn(TINY_RING)
    _, _, desc = prod.put("p", "c", "k", {"t": torch.ones(4)})
    assert desc["plane"] == "ring"
    mv = prod._sender._edges[("p", "c")].ring._mv
    base = ringmod.HEADER_SIZE + desc["pos"] + ringmod.FRAME_HDR
    prefix = framemod.PREFIX.unpack_from(mv, base)
    assert prefix[1] == framemod.KIND_TDICT
    hl = prefix[4]
    start = base + framemod.PREFIX_SIZE
    items = msgspec.msgpack.decode(bytes(mv[start : start + hl]))
    small_start = base + framemod._align(framemod.PREFIX_SIZE + hl)
    small = bytes(mv[small_start : small_start + prefix[5]])
    items[field] = value
    frame = framemod.EncodedFrame(
        framemod.KIND_TDICT,
        msgspec.msgpack.encode(items),
        [(0, memoryview(small))],
        [],
        prefix[5],
        0,
    )
    slot = ringmod.FRAME.unpack_from(mv, base - ringmod.FRAME_HDR)[0]
    assert frame.total <= slot - ringmod.FRAME_HDR
    frame.write_into(mv[base : base - ringmod.FRAME_HDR + slot])
    assert c.get("p", "c", "k") is None
    assert c.health()["corrupt_frames"] == 1
    prod.put("p", "c", "k2", {"t": torch.arange(3)})
    assert torch.equal(c.get("p", "c", "k2")[0]["t"], torch.arange(3))


def test_receive_thread_not_blocked_by_same_process_sender(make_conn):
    c = make_conn(TINY_RING)
    c.put("p", "c", "k", "v")
    c._sender._lock.acquire()  # a sender stuck (e.g. waiting on a ring lock)
    try:
        res: queue.Queue = queue.Queue()
        t = threading.Thread(
            target=lambda: res.put(
                c.get_with_deadline("p", "c", "k", deadline=time.monotonic() + 10)
            )
        )
        t.start()
        r = res.get(timeout=30)
        t.join()
    finally:
        c._sender._lock.release()
    assert r is not None and r[0] == "v"


def test_soak_leaves_nothing_behind(scope, make_conn, ring_bytes):
    prod, c = make_conn(ring_bytes), make_conn(TINY_RING)
    for i in range(300):
        payload = {"t": torch.full((i % 700 + 1,), i)}
        prod.put("p", "c", f"k{i}", payload)
        if i % 7 == 0:
            prod.put("p", "c", f"k{i}", payload)  # re-put
        if i % 11 == 0:
            assert prod.cleanup(f"k{i}")
            continue
        r = c.get("p", "c", f"k{i}")
        assert r is not None and r[0]["t"][0].item() == i
    prod.close()
    c.close()
    assert not os.path.exists(scope_path(scope))


def test_trainer_receives_finished_payload_by_key(scope, make_conn):
    """The documented recipe: a co-located process takes a request's payload."""
    out = helpers.CTX.Queue()
    p = helpers.CTX.Process(target=helpers.trainer, args=(scope, "req_17_0", out))
    p.start()
    engine = make_conn()
    experts = torch.randint(0, 64, (12, 4, 2), dtype=torch.int32)
    time.sleep(0.05)
    assert engine.put("engine", "trainer", "req_17_0", {"routed_experts": experts})[0]
    assert out.get(timeout=60) == experts.sum().item()
    p.join(30)


def test_fallback_miss_attaches_nothing_logs_no_error(make_conn, monkeypatch, caplog):
    c = make_conn(0)

    def no_mmap(*a, **k):
        raise AssertionError("attached on a miss")

    monkeypatch.setattr(perkey.mmap, "mmap", no_mmap)
    with caplog.at_level(logging.DEBUG):
        assert c.get("p", "c", "nothing") is None
        assert c.get_with_deadline("p", "c", "nothing", deadline=0) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert c.health()["rings_mapped"] == 0
    assert framemod  # module used for monkeypatching in helpers


def test_successive_producers_in_one_process_are_seen(make_conn, ring_bytes):
    """A new connector of the same process (same ring name, its own per-key
    token writes) is never hidden by the empty-poll fast path."""
    r = make_conn(TINY_RING)
    old = make_conn(ring_bytes)
    for i in range(3):
        old.put("p", "c", f"old{i}", i)
        assert r.get("p", "c", f"old{i}")[0] == i
    old.close()
    assert r.get("p", "c", "x") is None  # missed with the current token
    new = make_conn(ring_bytes)
    for i in range(2):
        new.put("p", "c", f"new{i}", i)
    new.put("p", "c", "x", "found")
    got = r.get("p", "c", "x")
    assert got is not None and got[0] == "found"
