# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routed-experts capture for the Artifact Connector, on top of the base's
router capture hooks (``routed_experts_capturer``)."""

from vllm.model_executor.layers.fused_moe.routed_experts_capture.state import (
    CaptureState,
)

__all__ = ["CaptureState"]
