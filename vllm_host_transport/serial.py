# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``KIND_SERIAL``: vLLM's ordinary serializer, as the tensor frames use it.

A payload the tree walk cannot express (see :mod:`.encode`) is encoded with
:class:`vllm.v1.serial_utils.MsgpackEncoder`, subclassed so tensors, numpy
arrays and PIL images are tagged with the transport's extension codes and an
untyped receiver can rebuild them; :class:`~vllm.v1.serial_utils.MsgpackDecoder`
is subclassed to match. Unknown extension values come back as
``msgspec.msgpack.Ext``, and pickled values are refused on receipt.

Importing this module imports neither vLLM nor torch: the classes are made
(importing vLLM, and so torch) the first time a payload needs them.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from vllm_host_transport import frame
from vllm_host_transport.frame import (
    EXT_SER_IMAGE,
    EXT_SER_NDARRAY,
    EXT_SER_TENSOR,
    CorruptFrame,
    PayloadTooLarge,
    _materialize,
)

# vLLM's serializer codes: raw buffer view (accepted) and pickle (refused).
_SER_RAW_VIEW = 3
_SER_PICKLE = frozenset({1, 2})


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
            tensor = frame._tensor_type()  # vllm imported torch
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
