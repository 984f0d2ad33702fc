# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tensor frames: the wire format shared by the host ring and per-key segments.

A frame is a fixed prefix, a msgpack header and two areas of raw regions::

    [prefix 32 B][header][pad to 64][small area][pad to 64][large area]

The prefix holds a magic, the frame kind, the header length and the sizes of
both areas. Two kinds exist:

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

On receipt, the small area is copied into one owned ``bytearray`` that all
small leaves share, and every leaf of ``large_leaf_bytes`` or more is copied
into an allocation of its own, so keeping small metadata alive never pins a
large hidden state. Nothing returned refers to shared memory.

Neither torch nor vLLM is imported with this module, so a process without
them (a trainer with numpy only) can send and receive numpy, struct and plain
payloads. torch is imported when a frame that holds tensors is decoded, and
its tables are filled when this process first encodes a tensor (a value can
only be a tensor once its process imported torch: ``sys.modules`` says so,
nothing is imported to find out). vLLM is imported only for a ``KIND_SERIAL``
frame; without it such a payload is refused with an error naming its type.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import msgspec
import numpy as np

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
_RESERVED_EXT = frozenset(
    {EXT_TENSOR, EXT_NDARRAY, EXT_STRUCT, EXT_SER_TENSOR, EXT_SER_NDARRAY}
    | {EXT_SER_IMAGE, 1, 2, 3}
)

# vLLM's serializer codes: raw buffer view (accepted) and pickle (refused).
_SER_RAW_VIEW = 3
_SER_PICKLE = frozenset({1, 2})

_NDARRAY_KINDS = frozenset("biufcmM")
_SCALARS = (str, int, float, bool, bytes, type(None))


class PayloadTooLarge(ValueError):
    """A payload or one of its arrays exceeds ``max_payload_bytes``."""


class CorruptFrame(ValueError):
    """A frame failed validation while being decoded."""


class _Unsupported(Exception):
    """The tree walk met a value a tensor frame cannot express."""


def _align(n: int, a: int = AREA_ALIGN) -> int:
    return (n + a - 1) & ~(a - 1)


class _DtypeNames(dict):
    def __missing__(self, dtype: torch.dtype) -> str:
        name = str(dtype).removeprefix("torch.")
        self[dtype] = name
        return name


_DTYPE_NAMES = _DtypeNames()
_TDICT_MAX_ENTRIES = 64

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


def _torch_dtypes() -> dict[str, torch.dtype]:
    """The dtypes by name, for decoding a frame that holds tensors (imports
    torch, which such a frame needs)."""
    if _Tensor is None:
        try:
            _load_torch()
        except ImportError as e:
            raise CorruptFrame(
                f"the frame holds torch tensors and torch is not importable "
                f"in this process ({e})"
            ) from e
    return _DTYPES_BY_NAME


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

    def _region(self, mv: memoryview) -> tuple[int, int]:
        n = len(mv)
        if n >= self.large_leaf_bytes:
            off = self.large_total
            self.large.append((off, mv))
            self.large_total = _align(off + n)
            return 1, off
        off = self.small_total
        self.small.append((off, mv))
        self.small_total = _align(off + n, 16)
        return 0, off

    def _tensor_region(self, t: torch.Tensor, n: int) -> tuple[int, int]:
        """Like :meth:`_region` for a contiguous CPU tensor of ``n`` bytes:
        the tensor itself is the region (copied by address into a ring)."""
        if n >= self.large_leaf_bytes:
            off = self.large_total
            self.large.append((off, t))
            self.large_total = _align(off + n)
            return 1, off
        off = self.small_total
        self.small.append((off, t))
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
        tensor = _Tensor if _Tensor is not None else _tensor_type()
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
        if not t.is_cpu or t.layout != _STRIDED:
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
            if type(t) is not _Tensor:
                t = t.as_subclass(_Tensor)  # plain tensor for the region
            area, off = self._tensor_region(t, nbytes)
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
            area, off = self._region(c.reshape(-1).view(np.uint8).data)
        return msgspec.msgpack.Ext(
            EXT_NDARRAY,
            self.meta.encode((a.dtype.str, a.shape, area, off, a.nbytes)),
        )

    def _struct(self, s: msgspec.Struct) -> msgspec.msgpack.Ext:
        cls = type(s)
        fields = [self.walk(getattr(s, f)) for f in cls.__struct_fields__]
        path = struct_type_name(cls)
        return msgspec.msgpack.Ext(EXT_STRUCT, self.meta.encode((path, fields)))


_SERIAL_CLASSES: tuple[type[Any], type[Any]] | None = None


def _serial_classes() -> tuple[type[Any], type[Any]]:
    """``(_SerialEncoder, _SerialDecoder)``: vLLM's ordinary serializer with
    the transport's extensions, made (importing vLLM, and so torch) the first
    time a payload needs the ``KIND_SERIAL`` fallback. Raises ``ImportError``
    where vLLM is not importable."""
    global _SERIAL_CLASSES
    if _SERIAL_CLASSES is not None:
        return _SERIAL_CLASSES
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    class _SerialEncoder(MsgpackEncoder):
        """vLLM's ordinary serializer, with tensors, arrays and images tagged so an
        untyped receiver can rebuild them. Buffers of every array go out of band."""

        def __init__(self, limit: int) -> None:
            super().__init__(size_threshold=256)
            self.limit = limit
            self._inner = msgspec.msgpack.Encoder()

        def enc_hook(self, obj: Any) -> Any:
            tensor = _tensor_type()  # vllm imported torch
            if tensor is not None and isinstance(obj, tensor):
                nbytes = obj.numel() * obj.element_size()
                if nbytes > self.limit:
                    raise PayloadTooLarge(f"tensor of {nbytes} bytes is too large")
                enc = self._encode_tensor(_materialize(obj))
                return msgspec.msgpack.Ext(EXT_SER_TENSOR, self._inner.encode(enc))
            if isinstance(obj, np.ndarray) and obj.dtype.kind not in ("O", "V"):
                if obj.nbytes > self.limit:
                    raise PayloadTooLarge(f"array of {obj.nbytes} bytes is too large")
                enc = self._encode_ndarray(obj)
                return msgspec.msgpack.Ext(EXT_SER_NDARRAY, self._inner.encode(enc))
            if _is_pil_image(obj):
                arr = np.asarray(obj)
                enc = self._encode_ndarray(arr)
                payload = (obj.mode, tuple(obj.size), enc)
                return msgspec.msgpack.Ext(EXT_SER_IMAGE, self._inner.encode(payload))
            return super().enc_hook(obj)

    class _SerialDecoder(MsgpackDecoder):
        """Decoder matching :class:`_SerialEncoder`; unknown extension values are
        returned as ``msgspec.msgpack.Ext`` so user extensions survive."""

        def __init__(self) -> None:
            super().__init__(share_mem=True)
            self._inner = msgspec.msgpack.Decoder(ext_hook=self.ext_hook)

        def ext_hook(self, code: int, data: memoryview) -> Any:
            if code == EXT_SER_TENSOR:
                return self._decode_tensor(self._inner.decode(data))
            if code == EXT_SER_NDARRAY:
                arr = self._decode_ndarray(self._inner.decode(data))
                arr.flags.writeable = False
                return arr
            if code == EXT_SER_IMAGE:
                from PIL import Image

                mode, size, enc = self._inner.decode(data)
                arr = self._decode_ndarray(enc)
                img = Image.fromarray(np.array(arr))
                return img if img.mode == mode else img.convert(mode)
            if code == _SER_RAW_VIEW:
                return super().ext_hook(code, data)
            if code in _SER_PICKLE:
                # Never unpickle what another process left in shared memory, even
                # where VLLM_ALLOW_INSECURE_SERIALIZATION is set.
                raise CorruptFrame("pickled values are not accepted from shared memory")
            return msgspec.msgpack.Ext(code, bytes(data))

    _SERIAL_CLASSES = (_SerialEncoder, _SerialDecoder)
    return _SERIAL_CLASSES


def _is_pil_image(obj: Any) -> bool:
    mod = type(obj).__module__
    if not mod.startswith("PIL."):
        return False
    from PIL import Image

    return isinstance(obj, Image.Image)


class FrameCodec:
    """Encodes payloads into frames and decodes frames into owned objects.

    Not thread-safe: a connector keeps one codec for sending and one for
    receiving, each used under its own lock.
    """

    def __init__(
        self,
        max_payload_bytes: int,
        large_leaf_bytes: int,
        struct_types: Sequence[type[msgspec.Struct]] = (),
    ) -> None:
        self.limit = max_payload_bytes
        self.large_leaf_bytes = large_leaf_bytes
        self._header_enc = msgspec.msgpack.Encoder()
        self._header_dec = msgspec.msgpack.Decoder(ext_hook=self._ext_hook)
        self._meta_dec = msgspec.msgpack.Decoder()
        self._serial_enc: Any = None  # _serial_classes()[0], made on first use
        self._serial_dec: Any = None
        self.serial_fallbacks = 0
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

    # ------------------------------------------------------------------ encode
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
        tensor = _Tensor if _Tensor is not None else _tensor_type()
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
                or t.layout is not _STRIDED
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

    # ------------------------------------------------------------------ decode
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
        dtypes = _DTYPES_BY_NAME or _torch_dtypes()
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
        frombuffer = _torch.frombuffer  # loaded: the entries named its dtypes
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
        dtypes = _DTYPES_BY_NAME or _torch_dtypes()
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
            return _torch.empty(shape, dtype=dtype)
        buf, s = self._region(area, off, nbytes)
        if area == 0:
            return _torch.frombuffer(buf, dtype=dtype, count=numel, offset=s).view(
                shape
            )
        # A large leaf gets an owned allocation of its own.
        own = bytearray(buf[s : s + nbytes])
        return _torch.frombuffer(own, dtype=dtype, count=numel).view(shape)

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
