# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tensor frames: the wire format shared by the host ring and per-key segments.

A frame is a fixed prefix, a msgpack header and two areas of raw regions::

    [prefix 32 B][header][pad to 64][small area][pad to 64][large area]

The prefix holds a magic, the frame kind, the header length and the sizes of
both areas. Three kinds exist:

* ``KIND_TFRAME``: the header is the payload tree in msgpack where every tensor,
  numpy array and typed struct is an extension value. Tensor and array
  extensions name a region (area, offset, size) instead of carrying bytes, so
  the data is copied once, straight from the source tensor into the
  destination (ring slot or segment file).
* ``KIND_SERIAL``: anything the tree walk cannot express goes through vLLM's
  ordinary serializer (:class:`vllm.v1.serial_utils.MsgpackEncoder`); its
  buffers become the regions and the header lists them.
* ``KIND_TDICT``: the fast path for the most common payload, a flat ``dict``
  of ``str`` keys to non-empty, contiguous, plain CPU tensors. The header is
  one flat msgpack array of ``key, dtype, shape, area, offset, nbytes`` per
  entry: no extension values, no per-leaf nested decode.

This module holds what both directions share: the format's constants and
errors, the dtype tables, an encoded frame (:class:`EncodedFrame`, or a
:class:`RawFrame` copied out of a ring slot) and how one is written into a
buffer or a file. Payloads are encoded into frames by :mod:`.encode` and
decoded by :mod:`.decode`; :class:`~.codec.FrameCodec` does both.

Neither torch nor vLLM is imported with this module, so a process without
them (a trainer with numpy only) can send and receive numpy, struct and plain
payloads. The torch tables below are filled when this process first encodes a
tensor (a value can only be a tensor once its process imported torch:
``sys.modules`` says so, nothing is imported to find out) or decodes a frame
that holds tensors. Other modules read them as attributes of this module
(``frame._Tensor``): they are bound once torch is loaded.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch

MAGIC = b"HTF1"
KIND_TFRAME = 1
KIND_SERIAL = 2
KIND_TDICT = 3

PREFIX = struct.Struct("<4sBBHIQQ")
PREFIX_SIZE = 32
AREA_ALIGN = 64

# Extension codes of the tensor frame header (never on the plain serializer).
EXT_TENSOR = 121
EXT_NDARRAY = 122
EXT_STRUCT = 123
# Extension codes added to the ordinary serializer for untyped decoding.
EXT_SER_TENSOR = 110
EXT_SER_NDARRAY = 111
EXT_SER_IMAGE = 112

_NDARRAY_KINDS = frozenset("biufcmM")


class PayloadTooLarge(ValueError):
    """A payload or one of its arrays exceeds ``max_payload_bytes``."""


class CorruptFrame(ValueError):
    """A frame failed validation while being decoded."""


def _align(n: int, a: int = AREA_ALIGN) -> int:
    return (n + a - 1) & ~(a - 1)


class _DtypeNames(dict):
    def __missing__(self, dtype: torch.dtype) -> str:
        name = str(dtype).removeprefix("torch.")
        self[dtype] = name
        return name


_DTYPE_NAMES = _DtypeNames()

# The torch tables, filled by _load_torch() the first time this process
# encodes or decodes a tensor; until then _Tensor is None (and
# ``type(x) is _Tensor`` is false for every x).
_torch: Any = None  # the torch module
_Tensor: Any = None  # torch.Tensor
_STRIDED: Any = None  # torch.strided
# Every CPU dtype a frame may name, by name (decoding never calls getattr on
# the torch module with a name read from shared memory).
_DTYPES_BY_NAME: dict[str, torch.dtype] = {}
# dtypes numpy can view directly (no torch-side reinterpretation needed).
_NUMPY_OK: frozenset[torch.dtype] = frozenset()


def _load_torch() -> Any:
    """Import torch, fill the tables above and return ``torch.Tensor``.
    Idempotent; ``_Tensor`` is set last, so a thread that sees it set sees
    every table filled."""
    global _torch, _STRIDED, _DTYPES_BY_NAME, _NUMPY_OK, _Tensor
    import torch

    by_name = {
        _DTYPE_NAMES[d]: d
        for d in (
            torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
            torch.int64, torch.float16, torch.bfloat16, torch.float32,
            torch.float64, torch.complex64, torch.complex128,
        )
    }  # fmt: skip
    for name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
        d = getattr(torch, name, None)
        if isinstance(d, torch.dtype):
            by_name[name] = d
    _torch = torch
    _STRIDED = torch.strided
    _DTYPES_BY_NAME = by_name
    _NUMPY_OK = frozenset(
        {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32}
        | {torch.int64, torch.float16, torch.float32, torch.float64}
        | {torch.complex64, torch.complex128}
    )
    _Tensor = torch.Tensor
    return _Tensor


def _tensor_type() -> Any:
    """``torch.Tensor`` if this process has imported torch, else ``None``.
    Never imports torch: without it in ``sys.modules`` no value is a tensor."""
    if _Tensor is not None:
        return _Tensor
    if sys.modules.get("torch") is None:  # not imported (or blocked)
        return None
    return _load_torch()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous, conj/neg-resolved CPU tensor (no copy)."""
    if t.dtype in _NUMPY_OK:
        return t.numpy().data.cast("B")
    return t.reshape(-1).view(_torch.uint8).numpy().data


def _materialize(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


_memmove = ctypes.memmove
# A region's source: a byte memoryview, or (tensor-dict frames) a contiguous
# CPU tensor that is copied by address.
Region = tuple[int, Any]


def _region_bytes(src: Any) -> Any:
    return _tensor_bytes(src) if type(src) is _Tensor else src


class EncodedFrame:
    """An encoded payload, ready to be copied into a ring slot or a file."""

    __slots__ = (
        "kind", "header", "small", "large", "small_total", "large_total",
        "small_start", "large_start", "total",
    )  # fmt: skip

    def __init__(
        self,
        kind: int,
        header: bytes,
        small: list[Region],
        large: list[Region],
        small_total: int,
        large_total: int,
    ) -> None:
        self.kind = kind
        self.header = header
        self.small = small
        self.large = large
        self.small_total = small_total
        self.large_total = large_total
        self.small_start = ss = (PREFIX_SIZE + len(header) + 63) & ~63
        self.large_start = ls = (ss + small_total + 63) & ~63
        self.total = ls + large_total

    def write_into(self, dst: memoryview, dst_addr: int = 0) -> None:
        """Copy the whole frame into ``dst`` (at least ``total`` bytes).

        ``dst_addr``, when given, is the address of ``dst[0]`` (a mapping the
        caller keeps alive); tensor regions are then copied by address."""
        header = self.header
        hl = len(header)
        PREFIX.pack_into(
            dst, 0, MAGIC, self.kind, 0, 0, hl, self.small_total, self.large_total
        )
        dst[PREFIX_SIZE : PREFIX_SIZE + hl] = header
        for base, regions in (
            (self.small_start, self.small),
            (self.large_start, self.large),
        ):
            for off, src in regions:
                s = base + off
                if type(src) is _Tensor:
                    n = src.nbytes
                    if s + n > len(dst):
                        raise ValueError("frame larger than its destination")
                    if dst_addr:
                        _memmove(dst_addr + s, src.data_ptr(), n)
                        continue
                    src = _tensor_bytes(src)
                dst[s : s + len(src)] = src

    def iovecs(self) -> list[Any]:
        """The frame as a gather list (for ``os.writev``), padding included."""
        prefix = PREFIX.pack(
            MAGIC, self.kind, 0, 0, len(self.header), self.small_total, self.large_total
        )
        out: list[Any] = [prefix, bytes(PREFIX_SIZE - len(prefix)), self.header]
        pos = PREFIX_SIZE + len(self.header)
        for base, regions in (
            (self.small_start, self.small),
            (self.large_start, self.large),
        ):
            for off, src in regions:
                mv = _region_bytes(src)
                s = base + off
                if s > pos:
                    out.append(bytes(s - pos))
                out.append(mv)
                pos = s + len(mv)
        if self.total > pos:
            out.append(bytes(self.total - pos))
        return out


class RawFrame:
    """An already encoded frame (bytes copied out of a ring slot), written to
    a segment file like an :class:`EncodedFrame`."""

    __slots__ = ("data", "total")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.total = len(data)

    def iovecs(self) -> list[Any]:
        return [self.data]


def struct_type_name(cls: type) -> str:
    """The ``module:QualName`` a frame names a struct class by."""
    return f"{cls.__module__}:{cls.__qualname__}"


def write_frame_to_fd(fd: int, frame: EncodedFrame | RawFrame) -> None:
    """Write a whole frame to a file descriptor with gathered writes."""
    iov: Sequence[Any] = frame.iovecs()
    iov_max = 512
    i = 0
    while i < len(iov):
        chunk = list(iov[i : i + iov_max])
        want = sum(len(memoryview(b)) for b in chunk)
        done = os.writev(fd, chunk)
        if done < want:
            # Short write: finish this chunk piece by piece.
            skip = done
            for b in chunk:
                mv = memoryview(cast(Any, b)).cast("B")
                if skip >= len(mv):
                    skip -= len(mv)
                    continue
                mv = mv[skip:]
                skip = 0
                while mv:
                    mv = mv[os.write(fd, mv) :]
        i += iov_max
