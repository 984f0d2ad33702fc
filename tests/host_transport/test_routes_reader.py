# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``routes_reader`` on real read-many objects of the host transport: token
ranges across digested chunks, layer selections, dtypes, numpy and torch
buffers, padded and packed batches with their fill and ``cu_seqlens``, the
bytes counted, corruption found only where it is read, and typed errors for
bad arguments. The engine-side tests (tests/test_r3_trainer_slices.py) read
references of a real engine; these cover the arguments one by one."""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest

from vllm_host_transport import HostTransportConfig, HostTransportConnector
from vllm_host_transport.readmany import readable_name
from vllm_host_transport.routed_experts import (
    RoutedExpertsRef,
    RouteRefCorruptError,
    RouteRefInvalidError,
    RouteRefMissingError,
)
from vllm_host_transport.routes_format import encode
from vllm_host_transport.routes_reader import read, read_batch, release, stats

LAYERS, TOP_K = 6, 4


@pytest.fixture
def conn():
    c = HostTransportConnector(
        HostTransportConfig(scope=f"reader-{secrets.token_hex(6)}")
    )
    yield c
    c.close()


def _publish(conn, rows: np.ndarray, block_rows: int = 1024) -> dict:
    payload = encode(rows, block_rows=block_rows)
    key = secrets.token_hex(16)
    assert conn.put_readable(key, payload.parts)
    return RoutedExpertsRef.for_payload(
        payload, transport="host", location=conn.scope_name, key=key
    ).to_json()


def _rows(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 128, (n, LAYERS, TOP_K), dtype=np.uint8)


def test_slices_across_chunks_equal_the_array_and_count_their_bytes(conn):
    rows = _rows(2500, 0)  # chunks of 1,024 rows: 3 per layer
    ref = _publish(conn, rows)
    np.testing.assert_array_equal(read(ref), rows)
    for tokens in (slice(0, 1), slice(1000, 1100), slice(1023, 2049), slice(-7, None)):
        for layers in ([3], [1, 2, 5], range(LAYERS), slice(2, 4)):
            sel = (
                list(range(LAYERS))[layers]
                if isinstance(layers, slice)
                else list(layers)
            )
            want = rows[tokens][:, sel]
            before = stats()
            got = read(ref, tokens=tokens, layers=layers, dtype="int64")
            assert got.dtype == np.int64
            np.testing.assert_array_equal(got, want)
            lm = read(ref, tokens=tokens, layers=layers, layer_major=True)
            np.testing.assert_array_equal(lm, want.transpose(1, 0, 2))
            after = stats()
            # Each read: the header plus whole chunks of the selected layers.
            start, stop, _ = tokens.indices(len(rows))
            first, last = start // 1024, -(-stop // 1024)
            span = min(last * 1024, len(rows)) - first * 1024
            per_read = ref["header_nbytes"] + want.shape[1] * span * TOP_K
            assert after["bytes_read"] - before["bytes_read"] == 2 * per_read
            assert after["bytes_avoided"] - before["bytes_avoided"] == 2 * (
                ref["nbytes"] - want.shape[1] * span * TOP_K
            )


def test_a_padded_and_a_packed_batch(conn):
    arrays = [_rows(n, n) for n in (3, 1500, 0, 40)]
    refs = [_publish(conn, a, block_rows=512) for a in arrays]
    layers = [4, 0]
    padded, lengths = read_batch(refs, layers=layers, fill=255)
    assert padded.shape == (4, 1500, 2, TOP_K) and list(lengths) == [3, 1500, 0, 40]
    for b, a in enumerate(arrays):
        np.testing.assert_array_equal(padded[b, : len(a)], a[:, layers])
        assert (padded[b, len(a) :] == 255).all()
    packed, cu = read_batch(refs, layers=layers, packed=True, dtype="int32")
    assert list(cu) == [0, 3, 1503, 1503, 1543] and packed.dtype == np.int32
    for b, a in enumerate(arrays):
        np.testing.assert_array_equal(packed[cu[b] : cu[b + 1]], a[:, layers])
    # One token range per reference.
    spans = [slice(1, 3), slice(500, 1000), None, slice(0, 0)]
    packed, cu = read_batch(refs, tokens=spans, layers=layers, packed=True)
    assert list(np.diff(cu)) == [2, 500, 0, 0]
    np.testing.assert_array_equal(packed[2:], arrays[1][500:1000][:, layers])


def test_torch_buffers_pinned_or_not(conn):
    torch = pytest.importorskip("torch")
    arrays = [_rows(n, n) for n in (700, 1300)]
    refs = [_publish(conn, a) for a in arrays]
    out = torch.full((2, 1300, TOP_K), -1, dtype=torch.int64)
    got, cu = read_batch(
        refs[:1] + refs[1:], layers=[5], packed=True, layer_major=True,
        dtype=torch.int64, out=torch.empty((1, 2000, TOP_K), dtype=torch.int64),
    )  # fmt: skip
    assert isinstance(got, torch.Tensor) and isinstance(cu, torch.Tensor)
    assert torch.equal(got[0, :700], torch.from_numpy(arrays[0][:, 5].astype(np.int64)))
    one = read(refs[1], layers=[0, 1], layer_major=True, dtype=torch.int64, out=out)
    assert one is out
    want = arrays[1][:, [0, 1]].transpose(1, 0, 2).astype(np.int64)
    assert torch.equal(out, torch.from_numpy(np.ascontiguousarray(want)))


def test_bad_arguments_are_typed_and_read_nothing(conn):
    ref = _publish(conn, _rows(10, 1))
    cases = [
        dict(layers=[LAYERS]),  # no such layer
        dict(tokens=slice(0, 10, 2)),  # not contiguous
        dict(dtype="int8"),  # cannot hold uint8
        dict(dtype="float32"),
        dict(out=np.empty((10, LAYERS, TOP_K), np.int64)),  # not the dtype
        dict(out=np.empty((9, LAYERS, TOP_K), np.uint8)),  # not the shape
    ]
    for kw in cases:
        with pytest.raises(RouteRefInvalidError):
            read(ref, **kw)
    with pytest.raises(RouteRefInvalidError):
        read_batch([ref], fill=-1)  # does not fit uint8
    with pytest.raises(RouteRefInvalidError):
        read_batch([ref, _publish(conn, _rows(5, 2)[:, :3])])  # other layers
    with pytest.raises(RouteRefInvalidError):
        release([ref], reader=0)  # readers missing
    with pytest.raises(RouteRefInvalidError):
        read_batch(ref)  # one reference, not a sequence


def test_corruption_is_found_where_it_is_read_only(conn):
    rows = _rows(3000, 3)
    ref = _publish(conn, rows)
    path = os.path.join(conn.scope_dir, readable_name(ref["key"]))
    # Flip one byte of layer 2, rows 2048.. (its third chunk).
    body_at = os.path.getsize(path) - ref["nbytes"]
    at = body_at + (2 * 3000 + 2100) * TOP_K
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    np.testing.assert_array_equal(read(ref, layers=[0, 1, 3]), rows[:, [0, 1, 3]])
    np.testing.assert_array_equal(
        read(ref, tokens=slice(0, 2048), layers=[2]), rows[:2048, [2]]
    )
    with pytest.raises(RouteRefCorruptError, match="layer 2"):
        read(ref, tokens=slice(2047, 2049), layers=[2])


def test_the_last_of_n_readers_and_the_driver_release(conn):
    a, b = _publish(conn, _rows(20, 4)), _publish(conn, _rows(30, 5))
    assert release([a, b], reader=1, readers=3) == 0
    assert release([a, b], reader=1, readers=3) == 0  # idempotent per reader
    assert release([a], reader=0, readers=3) == 0
    read(a)
    assert release([a], reader=2, readers=3) == 1
    with pytest.raises(RouteRefMissingError):
        read(a)
    with pytest.raises(RouteRefInvalidError):
        release([b], reader=0, readers=4)  # another count than the first
    assert release([a, b]) == 1  # the driver: a is gone already
    with pytest.raises(RouteRefMissingError):
        read_batch([b])
