# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``AsyncLLM.pause_generation(wait_for_inflight_requests=...)``, the keyword
of vLLM before 0.32 that RL frameworks still pass (verl's
``abort_all_requests``, AReaL's pause route): accepted again as a deprecated
alias of ``mode``, so their pause really pauses instead of raising
``TypeError``."""

from __future__ import annotations

import warnings

from vllm.v1.engine import PauseMode

_warned = False


def pause_mode_from_alias(
    mode: PauseMode | None, wait_for_inflight_requests: bool | None
) -> PauseMode:
    """The pause mode for ``mode`` and the deprecated keyword: ``False`` is
    ``"abort"``, ``True`` is ``"wait"``; neither given is ``"abort"``."""
    global _warned
    if wait_for_inflight_requests is None:
        return "abort" if mode is None else mode
    alias: PauseMode = "wait" if wait_for_inflight_requests else "abort"
    if mode is not None and mode != alias:
        raise ValueError(
            f"pause_generation(mode={mode!r}, wait_for_inflight_requests="
            f"{wait_for_inflight_requests!r}) disagree: wait_for_inflight_requests"
            f"={wait_for_inflight_requests!r} means mode={alias!r}. Pass only "
            "mode (wait_for_inflight_requests is deprecated)."
        )
    if not _warned:
        _warned = True
        warnings.warn(
            "pause_generation(wait_for_inflight_requests=...) is deprecated; "
            f"use mode={alias!r}",
            FutureWarning,
            stacklevel=3,
        )
    return alias
