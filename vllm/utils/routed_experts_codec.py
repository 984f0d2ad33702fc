# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Client-side decoding of the ``routed_experts`` field of HTTP responses.

The server encodes the array with :func:`vllm.utils.serial_utils.numpy2base64`
(base64 of a ``.npy`` file: dtype and shape travel inside). This is its
inverse, for RL clients and tests; it never unpickles.
"""

from __future__ import annotations

import binascii
import io

import numpy as np
import pybase64

from vllm.utils.routed_experts_rows import ROUTED_EXPERTS_DTYPE_CODES


class RoutedExpertsDecodeError(ValueError):
    """The field is not a base64-encoded ``.npy`` array of routed experts."""


ROUTED_EXPERTS_DTYPES = tuple(ROUTED_EXPERTS_DTYPE_CODES)


def decode_routed_experts(b64: str) -> np.ndarray:
    """Decode ``choices[i].routed_experts`` into ``[tokens, layers, top_k]``."""
    try:
        raw = pybase64.b64decode(b64, validate=True)
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as exc:
        raise RoutedExpertsDecodeError(
            f"invalid routed_experts payload: {exc}"
        ) from exc
    if array.ndim != 3 or array.dtype not in ROUTED_EXPERTS_DTYPES:
        raise RoutedExpertsDecodeError(
            "routed_experts must be a uint8/int16/uint16/int32 [tokens, "
            f"layers, top_k] array, got {array.dtype} {array.shape}"
        )
    if array.size and array.dtype.kind == "i" and int(array.min()) < 0:
        raise RoutedExpertsDecodeError("routed_experts holds negative expert IDs")
    return array
