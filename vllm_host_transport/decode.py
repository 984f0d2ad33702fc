# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Decoding tensor frames into owned objects (the format is in :mod:`.frame`).

A frame may lie in shared memory another process can write, so
:class:`FrameDecoder` validates everything it reads before using it (magic,
kind, every region inside its area, dtype and shape against size, struct
types against the receiver's allow-list) and raises :class:`CorruptFrame`
for anything that fails. torch dtypes are looked up by name in a fixed table
and struct classes among those the receiver configured: no module is imported
and no attribute is looked up by a name read from shared memory.

On receipt, the small area is copied into one owned ``bytearray`` that all
small leaves share, and every leaf in the large area (``large_leaf_bytes`` or
more where it was encoded) is copied into an allocation of its own, so keeping
small metadata alive never pins a large hidden state. Nothing returned refers
to shared memory, unless the caller borrows from memory no other process can
reach (``decode(..., borrow=True)``).

torch is imported when a frame that holds tensors is decoded; vLLM only for
a ``KIND_SERIAL`` frame, which is refused (:class:`CorruptFrame`) where vLLM
is not importable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from vllm_host_transport import frame
from vllm_host_transport.frame import (
    _NDARRAY_KINDS,
    EXT_NDARRAY,
    EXT_STRUCT,
    EXT_TENSOR,
    KIND_SERIAL,
    KIND_TDICT,
    KIND_TFRAME,
    MAGIC,
    PREFIX,
    PREFIX_SIZE,
    CorruptFrame,
    _align,
    struct_type_name,
)
from vllm_host_transport.serial import _serial_classes

if TYPE_CHECKING:
    import torch


def _torch_dtypes() -> dict[str, torch.dtype]:
    """The dtypes by name, for decoding a frame that holds tensors (imports
    torch, which such a frame needs)."""
    if frame._Tensor is None:
        try:
            frame._load_torch()
        except ImportError as e:
            raise CorruptFrame(
                f"the frame holds torch tensors and torch is not importable "
                f"in this process ({e})"
            ) from e
    return frame._DTYPES_BY_NAME


class FrameDecoder:
    """Decodes frames into owned objects (:meth:`decode`).

    Not thread-safe: a connector keeps one codec for receiving, used under its
    lock.
    """

    def __init__(self, struct_types: Sequence[type[msgspec.Struct]] = ()) -> None:
        self._header_dec = msgspec.msgpack.Decoder(ext_hook=self._ext_hook)
        self._meta_dec = msgspec.msgpack.Decoder()
        self._serial_dec: Any = None  # _serial_classes()[1], made on first use
        # The struct classes a frame may name (receiving side): looked up by
        # name, never imported.
        self._struct_classes: dict[str, type[msgspec.Struct]] = {
            struct_type_name(c): c for c in struct_types
        }
        self._tdict_cache: dict[bytes, list[tuple[Any, ...]]] = {}
        # Decode state (valid only during one decode call).
        self._src: memoryview | None = None
        self._small: bytearray | None = None
        self._borrow = False
        self._large_start = 0
        self.last_size = 0

    def decode(self, src: memoryview, *, borrow: bool = False) -> Any:
        """Decode the frame at the start of ``src`` into owned objects.

        ``src`` may be shared memory; everything returned is a copy, except
        that with ``borrow`` a numpy array in the large area is a view of
        ``src`` (for a caller whose ``src`` is memory no other process can
        reach, such as a claimed segment mapped privately). Raises
        :class:`CorruptFrame` for anything that fails validation.
        """
        if len(src) < PREFIX_SIZE:
            raise CorruptFrame("frame shorter than its prefix")
        magic, kind, _flags, _rsv, hl, small_total, large_total = PREFIX.unpack_from(
            src
        )
        if magic != MAGIC:
            raise CorruptFrame("bad frame magic")
        small_start = _align(PREFIX_SIZE + hl)
        large_start = _align(small_start + small_total)
        if large_start + large_total > len(src):
            raise CorruptFrame("frame extends beyond its slot")
        header = src[PREFIX_SIZE : PREFIX_SIZE + hl]
        self.last_size = large_start + large_total
        try:
            if kind == KIND_TFRAME:
                self._src = src
                self._borrow = borrow
                self._small = (
                    bytearray(src[small_start : small_start + small_total])
                    if small_total
                    else None
                )
                self._large_start = large_start
                try:
                    return self._header_dec.decode(header)
                finally:
                    self._src = None
                    self._small = None
                    self._borrow = False
            if kind == KIND_TDICT:
                return self._decode_tdict(
                    src, header, small_start, small_total, large_start
                )
            if kind == KIND_SERIAL:
                return self._decode_serial(src, header, small_start, large_start)
        except CorruptFrame:
            raise
        except Exception as e:
            raise CorruptFrame(f"frame failed to decode: {e!r}") from e
        raise CorruptFrame(f"unknown frame kind {kind}")

    def _tdict_entries(self, header: memoryview) -> list[tuple[Any, ...]]:
        """Parse and validate a tensor-dict header into entries ``(key, dtype,
        shape, area, offset, nbytes, numel)``. A header repeats from message
        to message (same keys, dtypes and shapes), so validated entries are
        cached by the header's bytes; the checks that depend on the frame
        (regions inside their areas) are made for every frame."""
        hb = bytes(header)
        cache = self._tdict_cache
        entries = cache.get(hb)
        if entries is not None:
            return entries
        items = self._meta_dec.decode(hb)
        if type(items) is not list or not items or len(items) % 6:
            raise CorruptFrame("bad tensor-dict header")
        dtypes = frame._DTYPES_BY_NAME or _torch_dtypes()
        entries = []
        for i in range(0, len(items), 6):
            key, dtype_name, shape, area, off, nbytes = items[i : i + 6]
            dtype = dtypes.get(dtype_name) if type(dtype_name) is str else None
            if dtype is None or type(key) is not str or type(shape) is not list:
                raise CorruptFrame("bad tensor-dict entry")
            numel = 1
            for d in shape:
                if type(d) is not int or d < 0:
                    raise CorruptFrame("bad tensor shape")
                numel *= d
            if (
                type(off) is not int
                or type(nbytes) is not int
                or off < 0
                or nbytes <= 0
                or numel * dtype.itemsize != nbytes
            ):
                raise CorruptFrame("tensor size does not match its shape")
            if area not in (0, 1) or type(area) is not int:
                raise CorruptFrame("bad region area")
            entries.append((key, dtype, shape, area, off, nbytes, numel))
        if len(cache) >= 256:
            cache.clear()
        cache[hb] = entries
        return entries

    def _decode_tdict(
        self,
        src: memoryview,
        header: memoryview,
        small_start: int,
        small_total: int,
        large_start: int,
    ) -> dict[str, torch.Tensor]:
        entries = self._tdict_entries(header)
        # One owned buffer that every small leaf shares (bounds checked by
        # decode(): the small area lies inside the frame).
        small = bytearray(src[small_start : small_start + small_total])
        n_small = len(small)
        n_src = len(src)
        out: dict[str, torch.Tensor] = {}
        frombuffer = frame._torch.frombuffer  # loaded: the entries named its dtypes
        for key, dtype, shape, area, off, nbytes, numel in entries:
            if area == 0:
                if off + nbytes > n_small:
                    raise CorruptFrame("small region out of bounds")
                t = frombuffer(small, dtype=dtype, count=numel, offset=off)
            else:
                s = large_start + off
                if s + nbytes > n_src:
                    raise CorruptFrame("large region out of bounds")
                # Its own owned allocation (a bytearray is much cheaper to
                # allocate than torch.empty at these sizes).
                t = frombuffer(bytearray(src[s : s + nbytes]), dtype=dtype, count=numel)
            out[key] = t if len(shape) == 1 else t.view(shape)
        return out

    def _decode_serial(
        self, src: memoryview, header: memoryview, small_start: int, large_start: int
    ) -> Any:
        table = self._meta_dec.decode(header)
        bufs: list[Any] = []
        for area, off, n in table:
            s = (large_start if area else small_start) + off
            if s + n > len(src):
                raise CorruptFrame("region beyond frame")
            # Owned copies; numpy arrays are marked read-only on decode.
            bufs.append(bytearray(src[s : s + n]))
        if not bufs:
            raise CorruptFrame("empty serializer frame")
        if self._serial_dec is None:
            try:
                decoder_cls = _serial_classes()[1]
            except ImportError as e:
                raise CorruptFrame(
                    f"the frame was encoded by vLLM's serializer (KIND_SERIAL) "
                    f"and vllm is not importable in this process ({e})"
                ) from e
            self._serial_dec = decoder_cls()
        return self._serial_dec.decode(bufs)

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == EXT_TENSOR:
            return self._decode_tensor(data)
        if code == EXT_NDARRAY:
            return self._decode_ndarray(data)
        if code == EXT_STRUCT:
            return self._decode_struct(data)
        return msgspec.msgpack.Ext(code, bytes(data))

    def _region(self, area: int, off: int, nbytes: int) -> tuple[Any, int]:
        if area == 0:
            small = self._small
            if small is None or off < 0 or off + nbytes > len(small):
                raise CorruptFrame("small region out of bounds")
            return small, off
        src = self._src
        assert src is not None
        s = self._large_start + off
        if off < 0 or s + nbytes > len(src):
            raise CorruptFrame("large region out of bounds")
        return src, s

    def _decode_tensor(self, data: memoryview) -> torch.Tensor:
        dtype_name, shape, area, off, nbytes = self._meta_dec.decode(data)
        dtypes = frame._DTYPES_BY_NAME or _torch_dtypes()
        dtype = dtypes.get(dtype_name) if type(dtype_name) is str else None
        if dtype is None:
            raise CorruptFrame(f"unknown dtype {dtype_name!r}")
        numel = 1
        for d in shape:
            numel *= d
        itemsize = dtype.itemsize
        if numel * itemsize != nbytes:
            raise CorruptFrame("tensor size does not match its shape")
        if nbytes == 0:
            return frame._torch.empty(shape, dtype=dtype)
        buf, s = self._region(area, off, nbytes)
        if area == 0:
            return frame._torch.frombuffer(
                buf, dtype=dtype, count=numel, offset=s
            ).view(shape)
        # A large leaf gets an owned allocation of its own.
        own = bytearray(buf[s : s + nbytes])
        return frame._torch.frombuffer(own, dtype=dtype, count=numel).view(shape)

    def _decode_ndarray(self, data: memoryview) -> np.ndarray:
        dtype_str, shape, area, off, nbytes = self._meta_dec.decode(data)
        dtype = np.dtype(dtype_str)
        if dtype.kind not in _NDARRAY_KINDS:
            raise CorruptFrame(f"bad array dtype {dtype_str!r}")
        numel = 1
        for d in shape:
            numel *= d
        if numel * dtype.itemsize != nbytes:
            raise CorruptFrame("array size does not match its shape")
        if nbytes == 0:
            arr = np.empty(shape, dtype=dtype)
        else:
            buf, s = self._region(area, off, nbytes)
            if area == 0:
                arr = np.frombuffer(buf, dtype=dtype, count=numel, offset=s)
                arr = arr.reshape(shape)
            elif self._borrow:
                return np.frombuffer(buf, dtype=dtype, count=numel, offset=s).reshape(
                    shape
                )
            else:
                arr = np.empty(shape, dtype=dtype)
                arr.reshape(-1).view(np.uint8).data[:] = buf[s : s + nbytes]
        arr.flags.writeable = False
        return arr

    def _struct_class(self, path: Any) -> type[msgspec.Struct]:
        """The allowed ``msgspec.Struct`` class named ``module:QualName``.
        A frame can only name a class its receiver configured: decoding never
        imports a module or looks up an attribute by a name read from shared
        memory."""
        cls = self._struct_classes.get(path) if type(path) is str else None
        if cls is None:
            raise CorruptFrame(
                f"struct type {path!r} is not in the receiver's allowed_struct_types"
            )
        return cls

    def _decode_struct(self, data: memoryview) -> msgspec.Struct:
        path, fields = self._header_dec.decode(data)
        obj = self._struct_class(path)
        names = obj.__struct_fields__
        if len(names) != len(fields):
            raise CorruptFrame(f"field count mismatch for {path!r}")
        return obj(**dict(zip(names, fields)))
