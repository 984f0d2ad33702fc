# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The row format of routed experts (R3): one row per executed token,
``[num_layers, top_k]`` expert IDs of one of four dtypes.

A leaf module (numpy only): the config, the capture state, the artifact
store's envelopes and the client-side decoder all take the dtype table and
:class:`RowSpec` from here."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# The dtypes a row may have, with the code an object's envelope stores:
# uint8 up to 256 experts and int16 above (the defaults), uint16 (the base
# vLLM's choice above 256) and int32, both on request.
ROUTED_EXPERTS_DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype(np.uint8): 1,
    np.dtype(np.uint16): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
}
# The most experts int16, the widest default, can name.
MAX_DEFAULT_EXPERTS = 1 << 15


@dataclass(frozen=True)
class RowSpec:
    """Shape and dtype of one row (one executed token): ``[num_layers,
    top_k]`` expert ids."""

    num_layers: int
    top_k: int
    dtype: np.dtype = field(default_factory=lambda: np.dtype(np.uint8))

    def __post_init__(self) -> None:
        dt = np.dtype(self.dtype)
        object.__setattr__(self, "dtype", dt)
        if dt not in ROUTED_EXPERTS_DTYPE_CODES:
            names = [str(d) for d in ROUTED_EXPERTS_DTYPE_CODES]
            raise ValueError(f"artifact rows must be one of {names}, got {dt}")
        if not (0 < self.num_layers < 1 << 16 and 0 < self.top_k < 1 << 16):
            raise ValueError("num_layers and top_k must be in [1, 65535]")

    @classmethod
    def for_experts(cls, num_layers: int, top_k: int, num_experts: int) -> RowSpec:
        """uint8 when every expert id fits, else int16 (torch lacks most
        uint16 operations; trainers index with signed types)."""
        if not 0 < num_experts <= MAX_DEFAULT_EXPERTS:
            raise ValueError(
                f"unsupported number of experts {num_experts} for the default "
                f"dtypes (uint8 up to 256, int16 up to {MAX_DEFAULT_EXPERTS}): "
                'set --artifact-config \'{"routed_experts_dtype": "int32"}\''
            )
        dt = np.uint8 if num_experts <= 256 else np.int16
        return cls(num_layers, top_k, np.dtype(dt))

    @property
    def row_shape(self) -> tuple[int, int]:
        return (self.num_layers, self.top_k)

    @property
    def row_nbytes(self) -> int:
        return self.num_layers * self.top_k * self.dtype.itemsize
