# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The frontend side of routed experts (AsyncLLM / LLMEngine process).

Routes come with the engine's terminal output only. Two ends are decided in
the frontend, and both keep the request until that output arrives:

* a stop string found by the detokenizer: the engine does not know stop
  strings and keeps generating until the frontend's abort reaches it;
* an explicit abort whose caller waits (``AsyncLLM.abort``, ``POST
  /abort_requests``, the token-in/token-out abort): the caller gets the
  tokens it was sent and the routes of exactly those.

The engine's terminal output then carries routes for every token it
executed; the tokens computed past the frontend's end are dropped and the
routes cut to the tokens returned (:func:`finish_pending`). An abort whose
caller is gone (a client disconnect) is sent to the engine as such
(:func:`abort_items`): nothing is read for it.

Also here: :func:`remove_dead_stores`, run once the engine processes are
stopped.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from vllm.config.artifact import MAX_REF_HANDOFF_TIMEOUT_S
from vllm.distributed.artifact_connector.protocol import ACK_TIMEOUT_S, READ_TIMEOUT_S
from vllm.distributed.artifact_connector.store import ArtifactError
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState

logger = init_logger(__name__)

# How long a request the frontend ended (an abort, a stop string) waits for
# the engine's terminal output: past the sum of the engine's own bounds on a
# finished request (acknowledgement, read, hand-off), each of which answers
# with a reason; this one is for an engine that never answers.
ABORT_WAIT_S = ACK_TIMEOUT_S + READ_TIMEOUT_S + MAX_REF_HANDOFF_TIMEOUT_S + 10.0


# Why a streaming-input request is refused (each input chunk would start a
# new attempt; their routes are not stitched together).
STREAMING_INPUT_UNSUPPORTED = (
    "streaming-input requests (an async generator of StreamingInput as the "
    "prompt) are not supported with --enable-routed-experts: send each turn "
    "as its own request (its prompt holds the earlier turns; their routes "
    "come from the prefix cache)"
)


class ArtifactAbortTimeout(ArtifactError):
    """The terminal output of a request the frontend ended (an abort, a stop
    string) did not come from the engine."""


# ---------------------------------------------------------------- aborts
def abort_items(req_ids: Iterable[str], caller_waits: bool) -> list[Any]:
    """The ABORT payload for the engine: a request id where a caller waits
    for the routes, ``[request id, False]`` where it is gone."""
    if caller_waits:
        return list(req_ids)
    return [[req_id, False] for req_id in req_ids]


def engine_abort_items(
    processor: OutputProcessor, req_ids: list[str]
) -> tuple[list[Any], list[str]]:
    """After ``processor.abort_requests``: the ABORT payload for the engine
    and the ids the frontend holds for their routes. Only those are sent as
    requests whose caller waits; the frontend already answered the others
    (a caller gone, or aborted before its first token), so the engine reads
    nothing for them even if a token was on its way."""
    states = processor.request_states
    held = [r for r in req_ids if (st := states.get(r)) is not None and is_pending(st)]
    kept = set(held)
    return abort_items(held, True) + abort_items(
        [r for r in req_ids if r not in kept], False
    ), held


def abort_item_id(item: Any) -> str:
    """The request id of one :func:`abort_items` entry."""
    return item if isinstance(item, str) else item[0]


def split_abort_items(items: Iterable[Any]) -> tuple[list[str], list[str]]:
    """(every request id, the ids whose caller is gone)."""
    ids, gone = [], []
    for item in items:
        if isinstance(item, str):
            ids.append(item)
        else:
            ids.append(item[0])
            gone.append(item[0])
    return ids, gone


# Why a request the engine ended with an error of its own carries no routes.
ENGINE_ERROR_WITHOUT_ROUTES = (
    "ArtifactError: the engine ended the request with an error before its "
    "routes were read"
)

# Why an aborted request that had returned no token carries no routes.
ABORTED_BEFORE_FIRST_TOKEN = (
    "RequestAbortedError: aborted before its first token; no routes were "
    "computed for it"
)


def routes_missing_reason(
    req_state: RequestState, output: EngineCoreOutput
) -> str | None:
    """The reason a terminal output without routes (and without the engine's
    own reason) gives: an abort by the engine (a pause, a shutdown) of a
    request that had returned no token. None otherwise (or if set)."""
    from vllm.v1.engine import FinishReason

    if (
        output.finish_reason != FinishReason.ABORT
        or output.routed_experts is not None
        or req_state.routed_experts_error is not None
        or output.new_token_ids
        or req_state.detokenizer is None
        or req_state.detokenizer.num_output_tokens()
    ):
        return req_state.routed_experts_error
    return ABORTED_BEFORE_FIRST_TOKEN


def hold_abort(req_state: RequestState) -> bool:
    """An explicit abort of a request that returned tokens: keep it until
    the engine's terminal output brings the routes (returns True), with a
    deadline. A request aborted before its first token has no routes to
    wait for (False)."""
    if req_state.pending_abort_deadline is not None:
        return True  # aborted twice
    if req_state.pending_stop is not None:
        return True  # already ends at its stop string
    detok = req_state.detokenizer
    if detok is None or detok.num_output_tokens() == 0:
        req_state.routed_experts_error = ABORTED_BEFORE_FIRST_TOKEN
        return False
    req_state.pending_abort_deadline = time.monotonic() + ABORT_WAIT_S
    return True


def hold_stops(processor: OutputProcessor, req_ids: list[str]) -> list[str]:
    """After the aborts of requests that ended at a stop string were sent:
    give each one held for its routes the abort's deadline; returns their
    ids (for :func:`expire_pending_aborts`)."""
    deadline = time.monotonic() + ABORT_WAIT_S
    held = []
    for req_id in req_ids:
        req_state = processor.request_states.get(req_id)
        if (
            req_state is not None
            and req_state.pending_stop is not None
            and req_state.pending_abort_deadline is None
        ):
            req_state.pending_abort_deadline = deadline
            held.append(req_id)
    return held


def expire_pending_aborts(processor: OutputProcessor, req_ids: list[str]) -> None:
    """Finish the requests among ``req_ids`` that still wait for the engine
    past their deadline (an abort, or a stop string: :func:`hold_stops`),
    without routes and saying why (AsyncLLM calls this once the deadline has
    passed). A stop string without routes is an error, as in
    :func:`finish_pending`."""
    from vllm.v1.engine import FinishReason

    now = time.monotonic()
    for req_id in req_ids:
        req_state = processor.request_states.get(req_id)
        deadline = None if req_state is None else req_state.pending_abort_deadline
        if req_state is None or deadline is None or now < deadline:
            continue
        stop = req_state.pending_stop
        error = ArtifactAbortTimeout(
            f"the engine sent no terminal output within {ABORT_WAIT_S:g} s of "
            f"the {'stop string' if stop is not None else 'abort'}, so the "
            "request carries no routes"
        )
        logger.error("request %s: %s", req_id, error)
        req_state.pending_abort_deadline = None
        req_state.pending_stop = None
        req_state.routed_experts_error = f"{type(error).__name__}: {error}"
        reason = FinishReason.ABORT if stop is None else FinishReason.ERROR
        output = req_state.make_request_output([], None, reason, stop, None, None)
        if output is not None and req_state.queue is not None:
            req_state.queue.put(output)
        processor.lora_states.request_finished(req_id, req_state.lora_name)
        processor._finish_request(req_state)


def is_pending(req_state: RequestState) -> bool:
    return (
        req_state.pending_stop is not None
        or req_state.pending_abort_deadline is not None
    )


def finish_pending(req_state: RequestState, output: EngineCoreOutput) -> bool:
    """For a request the frontend ended (stop string or abort) that waits
    for its routes: returns whether ``output`` is the final one, rewritten
    into the frontend's finish (no tokens, routes cut to the returned
    tokens); earlier outputs only count the tokens past the end."""
    from vllm.v1.engine import FinishReason

    num_past = req_state.num_tokens_past_stop + len(output.new_token_ids)
    if not output.finished:
        req_state.num_tokens_past_stop = num_past
        return False
    output.new_token_ids = []
    output.new_logprobs = None
    output.new_sampling_mask = None
    if req_state.pending_stop is None:  # an abort, routes or not
        output.finish_reason = FinishReason.ABORT
        output.stop_reason = None
    elif output.artifact_error is None and output.finish_reason != FinishReason.ERROR:
        output.finish_reason = FinishReason.STOP
        output.stop_reason = req_state.pending_stop
    else:  # no routes: fail like any other finish whose routes failed
        if output.artifact_error is None:  # the engine failed it otherwise
            output.artifact_error = ENGINE_ERROR_WITHOUT_ROUTES
        output.finish_reason = FinishReason.ERROR
    # Every token the engine executed reached the frontend before this
    # output, so the routes end num_past rows after the returned tokens.
    if output.routed_experts is not None:
        keep = max(0, len(output.routed_experts) - num_past)
        output.routed_experts = output.routed_experts[:keep]
    ref = output.routed_experts_ref
    if ref is not None:  # the stored array stays whole; fetch returns these
        rows, layers, top_k = ref.shape
        output.routed_experts_ref = msgspec.structs.replace(
            ref, shape=(max(0, rows - num_past), layers, top_k)
        )
    req_state.pending_stop = None
    req_state.pending_abort_deadline = None
    return True


# ---------------------------------------------------------------- shutdown
def remove_dead_stores(vllm_config: VllmConfig, wait_s: float = 5.0) -> None:
    """Called by the frontend once its engine processes are stopped. A
    shutdown may kill them before the worker removes its store (``vllm
    serve`` on SIGINT does): remove the stores under the root whose writer is
    proven dead, waiting up to ``wait_s`` for this engine's killed workers to
    be gone, and the root when that leaves it empty. Live engines' stores are
    never touched."""
    import os

    from vllm.distributed.artifact_connector.shm import collect_stale_stores

    cfg = vllm_config.artifact_config
    if not cfg.enable_routed_experts:
        return
    ours = {
        cfg.namespace(rank)
        for rank in range(vllm_config.parallel_config.data_parallel_size)
    }
    deadline = time.monotonic() + wait_s
    while True:
        try:
            report = collect_stale_stores(cfg.shm_root, cfg.inactive_ttl_s)
        except (ArtifactError, OSError) as e:
            logger.warning("could not clean up the artifact store root: %s", e)
            return
        if report.removed:
            logger.info("removed artifact stores of dead engines: %s", report.removed)
        if not ours & set(report.kept_alive) or time.monotonic() > deadline:
            break
        time.sleep(0.1)  # a killed worker is still exiting
    with contextlib.suppress(OSError):
        os.rmdir(cfg.shm_root)
    _remove_dead_ref_scope(cfg.ref_scope)


def _remove_dead_ref_scope(scope: str | None) -> None:
    """Remove what killed engines left in the host-transport scope of
    routed-experts references: a receive that misses removes every dead
    producer's rings, segments and registration, whatever trainers hold the
    scope open, and the scope goes when no live process holds it. With the
    scope squatted, joining falls back as the engine does, which removes
    the fallback scopes killed engines left."""
    import os
    import secrets

    from vllm_host_transport import HostTransportConfig, HostTransportConnector
    from vllm_host_transport.discovery import HostTransportError, ScopeDir
    from vllm_host_transport.routed_experts import EDGE

    config = HostTransportConfig(scope=scope, scope_fallback=True)
    path = os.path.join(config.shm_root, ScopeDir.dir_name(config.resolved_scope()))
    if not os.path.isdir(path):
        return
    try:
        conn = HostTransportConnector(config)
        try:
            conn.get(EDGE[0], EDGE[1], secrets.token_hex(16))
        finally:
            conn.close()
    except (HostTransportError, OSError) as e:
        logger.warning("could not clean up routed-experts references: %s", e)
