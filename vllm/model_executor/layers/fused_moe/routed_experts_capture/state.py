# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One worker's capture state: the base's capturer, bound to the model's MoE
routers on every tensor-parallel rank, with IDs narrowed on the device."""

from __future__ import annotations

import numpy as np
import torch

from vllm.config import VllmConfig
from vllm.distributed.artifact_connector.request_core import RowSpec
from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
    RoutedExpertsCapturer,
    bind_routed_experts_capturer,
)

_TORCH_DTYPES = {
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.uint16): torch.uint16,
    np.dtype(np.int32): torch.int32,
}


class CaptureState:
    """Owns the capture buffer (``[max_num_batched_tokens, num_hidden_layers,
    top_k]`` int32 on the device). Routers write the rows of their layer in
    every forward; layers without a router are never written and stay zero,
    which is the documented value of a dense layer's row."""

    def __init__(
        self, model: torch.nn.Module, vllm_config: VllmConfig, spec: RowSpec
    ) -> None:
        self.spec = spec
        self.capturer = RoutedExpertsCapturer(
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            vllm_config=vllm_config,
        )
        if self.capturer.shape_per_token != spec.row_shape:
            raise ValueError(
                f"routed-experts rows are {spec.row_shape} but the capture "
                f"buffer holds {self.capturer.shape_per_token} per token"
            )
        self._dtype = _TORCH_DTYPES[spec.dtype]
        try:
            bind_routed_experts_capturer(model, self.capturer)
        except ValueError as e:
            raise ValueError(
                f"--enable-routed-experts cannot capture routes of this model: "
                f"{e} Serve it without the flag, or with a MoE kernel that "
                "supports routing capture (e.g. --moe-backend triton)."
            ) from e

    def snapshot(self, num_rows: int) -> torch.Tensor:
        """This step's rows, narrowed to the returned dtype, as a new tensor
        (the next forward overwrites the buffer)."""
        rows = self.capturer.device_buffer[:num_rows]
        if self._dtype == rows.dtype:
            return rows.clone()
        return rows.to(self._dtype)
