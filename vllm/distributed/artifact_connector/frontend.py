# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Frontend side of routed experts: a stop string found by the detokenizer.

The engine does not know about stop strings, so it keeps generating until
the frontend's abort arrives; its final output then carries routes for
every token it executed. The frontend keeps the request until that output
arrives, drops the tokens computed past the stop, and cuts the routes to
the tokens it returns."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.engine.output_processor import RequestState


def finish_pending_stop(req_state: RequestState, output: EngineCoreOutput) -> bool:
    """For a request waiting for its routes after a stop string: returns
    whether ``output`` is the final one, rewritten into the stop-string
    finish (no tokens, routes cut to the returned tokens); earlier outputs
    only count the tokens past the stop."""
    from vllm.v1.engine import FinishReason

    num_past = req_state.num_tokens_past_stop + len(output.new_token_ids)
    if not output.finished:
        req_state.num_tokens_past_stop = num_past
        return False
    output.new_token_ids = []
    output.new_logprobs = None
    output.new_sampling_mask = None
    if output.artifact_error is None:
        output.finish_reason = FinishReason.STOP
        output.stop_reason = req_state.pending_stop
    else:  # no routes: fail like any other finish whose routes failed
        output.finish_reason = FinishReason.ERROR
    if output.routed_experts is not None:
        # Every token the engine executed reached the frontend before this
        # output, so the routes end num_past rows after the returned tokens.
        keep = max(0, len(output.routed_experts) - num_past)
        output.routed_experts = output.routed_experts[:keep]
    req_state.pending_stop = None
    return True
