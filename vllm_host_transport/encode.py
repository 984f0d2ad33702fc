# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Encoding payloads into tensor frames (the format is in :mod:`.frame`).

:class:`FrameEncoder` picks the kind for each payload: a flat ``dict`` of up
to 64 ``str`` keys to non-empty, contiguous, plain CPU tensors takes
``KIND_TDICT``; any other tree of tensors, numpy arrays, ``msgspec.Struct``
values and msgpack values is walked (:class:`_TreeWalker`) into a
``KIND_TFRAME`` header and its regions; anything else falls back to vLLM's
serializer (``KIND_SERIAL``, see :mod:`.serial`), and is refused with a
``TypeError`` naming its type where vLLM is not importable.

The regions of a ``KIND_TDICT`` or ``KIND_TFRAME`` frame are views of the
source arrays (or the tensors themselves), copied once when the frame is
written into a ring slot or a segment file; only a non-contiguous, conjugate
or negative view is made contiguous first. Oversized arrays are refused
(:class:`PayloadTooLarge`) from their shape, before any such copy is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import msgspec
import numpy as np

from vllm_host_transport import frame
from vllm_host_transport.frame import (
    _DTYPE_NAMES,
    _NDARRAY_KINDS,
    EXT_NDARRAY,
    EXT_SER_IMAGE,
    EXT_SER_NDARRAY,
    EXT_SER_TENSOR,
    EXT_STRUCT,
    EXT_TENSOR,
    KIND_SERIAL,
    KIND_TDICT,
    KIND_TFRAME,
    EncodedFrame,
    PayloadTooLarge,
    Region,
    _align,
    _materialize,
    struct_type_name,
)
from vllm_host_transport.serial import _serial_classes

if TYPE_CHECKING:
    import torch

# Extension codes a user's ``msgspec.msgpack.Ext`` may not take in a tensor
# frame: the frame's own, the serializer's added ones and vLLM's (1-3).
_RESERVED_EXT = frozenset(
    {EXT_TENSOR, EXT_NDARRAY, EXT_STRUCT, EXT_SER_TENSOR, EXT_SER_NDARRAY}
    | {EXT_SER_IMAGE, 1, 2, 3}
)
_SCALARS = (str, int, float, bool, bytes, type(None))
_TDICT_MAX_ENTRIES = 64


class _Unsupported(Exception):
    """The tree walk met a value a tensor frame cannot express."""


class _TreeWalker:
    """Turns a payload tree into a frame header and a list of regions."""

    def __init__(self, limit: int, large_leaf_bytes: int) -> None:
        self.limit = limit
        self.large_leaf_bytes = large_leaf_bytes
        self.small: list[Region] = []
        self.large: list[Region] = []
        self.small_total = 0
        self.large_total = 0
        self.meta = msgspec.msgpack.Encoder()

    def _region(self, src: memoryview | torch.Tensor, n: int) -> tuple[int, int]:
        """Place ``src`` (``n`` bytes: a memoryview, or a contiguous CPU
        tensor, copied by address into a ring) in the small or the large
        area; returns (area, offset)."""
        if n >= self.large_leaf_bytes:
            off = self.large_total
            self.large.append((off, src))
            self.large_total = _align(off + n)
            return 1, off
        off = self.small_total
        self.small.append((off, src))
        self.small_total = _align(off + n, 16)
        return 0, off

    def _check_size(self, nbytes: int) -> None:
        if nbytes > self.limit or (
            self.small_total + self.large_total + nbytes > self.limit
        ):
            raise PayloadTooLarge(
                f"array of {nbytes} bytes exceeds max_payload_bytes={self.limit}"
            )

    def walk(self, obj: Any) -> Any:
        t = type(obj)
        if t in _SCALARS:
            return obj
        if t is dict:
            return {k: self.walk(v) for k, v in obj.items()}
        if t is list or t is tuple:
            return [self.walk(v) for v in obj]
        tensor = frame._Tensor if frame._Tensor is not None else frame._tensor_type()
        if tensor is not None and isinstance(obj, tensor):
            return self._tensor(obj)
        if isinstance(obj, np.ndarray):
            return self._ndarray(obj)
        if isinstance(obj, msgspec.Struct):
            return self._struct(obj)
        if t is msgspec.msgpack.Ext and obj.code not in _RESERVED_EXT:
            return obj
        raise _Unsupported(t)

    def _tensor(self, t: torch.Tensor) -> msgspec.msgpack.Ext:
        if not t.is_cpu or t.layout != frame._STRIDED:
            raise _Unsupported(type(t))
        dtype = t.dtype
        nbytes = t.numel() * dtype.itemsize
        self._check_size(nbytes)  # before any snapshot copy
        area, off = 0, 0
        if nbytes:
            if not (t.is_contiguous() and not t.is_conj() and not t.is_neg()):
                t = _materialize(t)
            elif t.requires_grad:
                t = t.detach()
            if type(t) is not frame._Tensor:
                t = t.as_subclass(frame._Tensor)  # plain tensor for the region
            area, off = self._region(t, nbytes)
        return msgspec.msgpack.Ext(
            EXT_TENSOR,
            self.meta.encode((_DTYPE_NAMES[dtype], t.shape, area, off, nbytes)),
        )

    def _ndarray(self, a: np.ndarray) -> msgspec.msgpack.Ext:
        if a.dtype.kind not in _NDARRAY_KINDS or a.dtype.hasobject:
            raise _Unsupported(type(a))
        self._check_size(a.nbytes)  # before any snapshot copy
        area, off = 0, 0
        if a.nbytes:
            c = a if a.flags.c_contiguous else np.ascontiguousarray(a)
            area, off = self._region(c.reshape(-1).view(np.uint8).data, a.nbytes)
        return msgspec.msgpack.Ext(
            EXT_NDARRAY,
            self.meta.encode((a.dtype.str, a.shape, area, off, a.nbytes)),
        )

    def _struct(self, s: msgspec.Struct) -> msgspec.msgpack.Ext:
        cls = type(s)
        fields = [self.walk(getattr(s, f)) for f in cls.__struct_fields__]
        path = struct_type_name(cls)
        return msgspec.msgpack.Ext(EXT_STRUCT, self.meta.encode((path, fields)))


class FrameEncoder:
    """Encodes payloads into frames (:meth:`encode`).

    Not thread-safe: a connector keeps one codec for sending, used under its
    lock.
    """

    def __init__(self, max_payload_bytes: int, large_leaf_bytes: int) -> None:
        self.limit = max_payload_bytes
        self.large_leaf_bytes = large_leaf_bytes
        self._header_enc = msgspec.msgpack.Encoder()
        self._serial_enc: Any = None  # _serial_classes()[0], made on first use
        self.serial_fallbacks = 0

    def encode(self, obj: Any) -> EncodedFrame:
        """Encode ``obj``; raises :class:`PayloadTooLarge` or ``TypeError``."""
        if type(obj) is dict:
            fast = self._encode_tdict(obj)
            if fast is not None:
                return fast
        walker = _TreeWalker(self.limit, self.large_leaf_bytes)
        try:
            tree = walker.walk(obj)
            header = self._header_enc.encode(tree)
        except _Unsupported as e:
            return self._encode_serial(obj, e.args[0])
        except (TypeError, OverflowError, msgspec.EncodeError):
            return self._encode_serial(obj)
        return EncodedFrame(
            KIND_TFRAME,
            header,
            walker.small,
            walker.large,
            walker.small_total,
            walker.large_total,
        )

    def _encode_tdict(self, obj: dict) -> EncodedFrame | None:
        """The ``KIND_TDICT`` fast path, or ``None`` when ``obj`` is not a flat
        dict of str keys to non-empty, contiguous, plain CPU tensors."""
        n = len(obj)
        if n == 0 or n > _TDICT_MAX_ENTRIES:
            return None
        tensor = frame._Tensor if frame._Tensor is not None else frame._tensor_type()
        if tensor is None:
            return None  # no torch in this process: no value is a tensor
        items: list[Any] = []
        small: list[Region] = []
        large: list[Region] = []
        small_total = large_total = 0
        limit = self.limit
        large_leaf = self.large_leaf_bytes
        for k, t in obj.items():
            if type(k) is not str or type(t) is not tensor:
                return None
            if (
                not t.is_cpu
                or t.layout is not frame._STRIDED
                or not t.is_contiguous()
                or t.is_conj()
                or t.is_neg()
            ):
                return None
            nbytes = t.nbytes
            if nbytes == 0:
                return None
            if nbytes > limit or small_total + large_total + nbytes > limit:
                raise PayloadTooLarge(
                    f"array of {nbytes} bytes exceeds max_payload_bytes={limit}"
                )
            if t.requires_grad:
                t = t.detach()
            # The tensor itself is the region: copied by address into the
            # ring, or through a byte view into a segment file.
            if nbytes >= large_leaf:
                area, off = 1, large_total
                large.append((off, t))
                large_total = (off + nbytes + 63) & ~63
            else:
                area, off = 0, small_total
                small.append((off, t))
                small_total = (off + nbytes + 15) & ~15
            items += (k, _DTYPE_NAMES[t.dtype], t.shape, area, off, nbytes)
        header = self._header_enc.encode(items)
        return EncodedFrame(KIND_TDICT, header, small, large, small_total, large_total)

    def _encode_serial(self, obj: Any, unsupported: type | None = None) -> EncodedFrame:
        """``obj`` through vLLM's serializer (``unsupported``: the type of the
        value the tree walk could not express, when it found one)."""
        if self._serial_enc is None:
            try:
                encoder_cls = _serial_classes()[0]
            except ImportError as e:
                inner = ""
                if unsupported is not None and unsupported is not type(obj):
                    inner = f" (it holds a value of type {unsupported})"
                raise TypeError(
                    f"payload of type {type(obj)}{inner} needs vLLM's serializer "
                    f"(KIND_SERIAL: not a tree of tensors, arrays, structs and "
                    f"msgpack values), and vllm is not importable in this "
                    f"process ({e})"
                ) from e
            self._serial_enc = encoder_cls(self.limit)
        try:
            bufs = self._serial_enc.encode(obj)
        except PayloadTooLarge:
            raise
        except Exception as e:
            raise TypeError(f"payload of type {type(obj)} is not serializable") from e
        self.serial_fallbacks += 1
        small: list[tuple[int, memoryview]] = []
        large: list[tuple[int, memoryview]] = []
        small_total = large_total = 0
        table = []
        for b in bufs:
            mv = memoryview(cast(Any, b)).cast("B")
            n = len(mv)
            if n >= self.large_leaf_bytes:
                table.append((1, large_total, n))
                large.append((large_total, mv))
                large_total = _align(large_total + n)
            else:
                table.append((0, small_total, n))
                small.append((small_total, mv))
                small_total = _align(small_total + n, 16)
        if small_total + large_total > self.limit:
            raise PayloadTooLarge("payload exceeds max_payload_bytes")
        header = self._header_enc.encode(table)
        return EncodedFrame(KIND_SERIAL, header, small, large, small_total, large_total)
