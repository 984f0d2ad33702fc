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


class RoutedExpertsDecodeError(ValueError):
    """The field is not a base64-encoded ``.npy`` array of routed experts."""


def decode_routed_experts(b64: str) -> np.ndarray:
    """Decode ``choices[i].routed_experts`` into ``[tokens, layers, top_k]``."""
    try:
        raw = pybase64.b64decode(b64, validate=True)
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as exc:
        raise RoutedExpertsDecodeError(
            f"invalid routed_experts payload: {exc}"
        ) from exc
    if array.ndim != 3 or array.dtype not in (np.uint8, np.uint16):
        raise RoutedExpertsDecodeError(
            f"routed_experts must be a uint8/uint16 [tokens, layers, top_k] "
            f"array, got {array.dtype} {array.shape}"
        )
    return array
