# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stored form of a request's routes handed out by reference.

One object per reference, written once by the engine and read by any
number of trainer ranks, each only the bytes of its slice::

    [header: u32 LE length n, n bytes of msgpack RoutesHeader, zero padding
             to a multiple of 64 bytes]
    [body:   routes, LAYER-major [layers, stored_rows, top_k], narrow dtype]

Why layer-major: a trainer rank replays the routers of its own pipeline
stage (a run of decoder layers) over its own tokens, one ``[tokens,
top_k]`` tensor per router (megatron-core's ``RouterReplay``). In this
layout each selected layer's token range is one contiguous byte range, so
a rank reads ``layers x 1`` ranges of exactly its bytes; in the token-major
layout of the inline array the same slice is a strided gather over every
row, which touches every page (and, over Mooncake, every byte).

Why per-chunk digests: a range read cannot check a digest of the whole
payload without reading all of it. The body is cut into chunks of one
layer x :data:`BLOCK_ROWS` rows, each with its own digest in the header;
the reference carries the header's digest. A reader verifies the header,
then only the chunks it read (a token range is widened to whole chunks:
at most ``2 x block_rows`` extra rows per layer). Host-transport objects
live in a private directory of the user, so xxh3-64 (corruption) suffices;
objects in a Mooncake Store can be replaced by anyone who reaches the
master, so there the chunk digests and the header's are SHA-256.

This module needs numpy, msgspec and xxhash only (no vLLM, no torch): the
engine encodes with it, trainers decode with it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import xxhash  # type: ignore[import-not-found,unused-ignore]

#: The stored form this module writes (a reference's ``format``).
FORMAT = 2
#: Rows per chunk: 1,024 rows of 8 uint8 IDs are an 8 KiB chunk; an 8k-token
#: request has 8 per layer (384 digests for 48 layers, 3 KiB of header on
#: the host transport).
BLOCK_ROWS = 1024
#: Digest of each chunk and of the header, by transport.
DIGESTS = {"xxh3_64": 8, "sha256": 32}
_ALIGN = 64


class RoutesHeader(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """What precedes the body (authenticated by the reference's digest)."""

    format: int
    stored_rows: int
    layers: int
    top_k: int
    dtype: str
    block_rows: int
    digest: str
    """``xxh3_64`` or ``sha256``: the digest of each chunk."""
    digests: bytes
    """Chunk ``(layer, block)``'s digest at index ``layer * blocks + block``
    (``blocks = ceil(stored_rows / block_rows)``), each ``DIGESTS[digest]``
    bytes."""

    @property
    def blocks(self) -> int:
        return -(-self.stored_rows // self.block_rows)


def digest_bytes(kind: str, data: Any) -> bytes:
    """The raw digest of ``data`` (a buffer) of kind ``kind``."""
    if kind == "sha256":
        return hashlib.sha256(data).digest()
    return xxhash.xxh3_64_digest(data)


def digest_hex(kind: str, data: Any) -> str:
    return digest_bytes(kind, data).hex()


@dataclass(frozen=True, slots=True)
class EncodedRoutes:
    """A payload ready to store: ``header`` then ``body`` (layer-major)."""

    header: bytes
    body: np.ndarray
    digest: str
    block_rows: int

    @property
    def parts(self) -> list[memoryview]:
        return [
            memoryview(self.header),
            memoryview(self.body.reshape(-1).view(np.uint8).data),
        ]

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.body.nbytes

    def header_digest_hex(self, kind: str) -> str:
        return digest_hex(kind, self.header)


def encode(
    rows: np.ndarray, digest: str = "xxh3_64", block_rows: int = BLOCK_ROWS
) -> EncodedRoutes:
    """The stored form of ``rows`` (``[rows, layers, top_k]``, token-major
    as the engine reads them): the body transposed to layer-major and every
    chunk's digest in the header."""
    if digest not in DIGESTS:
        raise ValueError(f"digest must be one of {', '.join(DIGESTS)}")
    if rows.ndim != 3:
        raise ValueError(f"routes must be [rows, layers, top_k], not {rows.shape}")
    stored_rows, layers, top_k = rows.shape
    body = np.ascontiguousarray(rows.transpose(1, 0, 2))
    blocks = -(-stored_rows // block_rows)
    flat = body.reshape(layers, stored_rows * top_k * body.itemsize)
    chunk = block_rows * top_k * body.itemsize
    out = bytearray()
    for layer in range(layers):
        lay = flat[layer]
        for b in range(blocks):
            out += digest_bytes(digest, lay[b * chunk : (b + 1) * chunk])
    header = msgspec.msgpack.encode(
        RoutesHeader(
            format=FORMAT,
            stored_rows=stored_rows,
            layers=layers,
            top_k=top_k,
            dtype=body.dtype.name,
            block_rows=block_rows,
            digest=digest,
            digests=bytes(out),
        )
    )
    framed = len(header).to_bytes(4, "little") + header
    padded = framed + b"\0" * (-len(framed) % _ALIGN)
    return EncodedRoutes(padded, body, digest, block_rows)


_DECODER = msgspec.msgpack.Decoder(RoutesHeader)


def decode_header(data: bytes | memoryview) -> RoutesHeader:
    """The header :func:`encode` framed at the start of ``data``. Raises
    ``ValueError`` when it is not one :func:`encode` wrote."""
    size = int.from_bytes(bytes(data[:4]), "little")
    if not 0 < size <= len(data) - 4:
        raise ValueError("not a routes header: bad length")
    try:
        header = _DECODER.decode(data[4 : 4 + size])
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ValueError(f"not a routes header: {e}") from e
    if header.format != FORMAT or header.digest not in DIGESTS:
        raise ValueError(f"unknown routes format {header.format}/{header.digest}")
    if header.stored_rows < 0 or header.block_rows <= 0:
        raise ValueError("bad routes header")
    expected = header.layers * header.blocks * DIGESTS[header.digest]
    if len(header.digests) != expected:
        raise ValueError(
            f"routes header holds {len(header.digests)} digest bytes, not {expected}"
        )
    return header
