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
routes cut to the tokens returned. An abort whose caller is gone (a client
disconnect) is sent to the engine as such (``protocol.abort_items``):
nothing is read for it. :class:`RoutedExpertsFrontend` is the one object
upstream's frontend holds for this.

Also here: :func:`remove_dead_stores`, run once the engine processes are
stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from vllm.config.artifact import MAX_REF_HANDOFF_TIMEOUT_S
from vllm.distributed.artifact_connector.protocol import (
    ACK_TIMEOUT_S,
    READ_TIMEOUT_S,
    abort_items,
)
from vllm.distributed.artifact_connector.store import ArtifactError
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.engine import EngineCoreOutput, FinishReason
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


@dataclass
class _Held:
    """A request the frontend ended that waits for the engine's terminal
    output."""

    stop: str | None  # the stop string that ended it; None: an abort
    past: int = 0  # tokens the engine computed past the frontend's end
    deadline: float | None = None  # set once the abort reached the engine


class RoutedExpertsFrontend:
    """The frontend's side of routed experts: one per ``OutputProcessor``
    (its ``routed_experts``, set by :meth:`attach`), holding the one record
    of each request the frontend ended that waits for its routes. The
    output processor, ``AsyncLLM`` and ``LLMEngine`` call it at their hook
    points; it reads their public state and never finishes a request
    itself: an expired one is finished through the ordinary output path."""

    def __init__(self, processor: OutputProcessor) -> None:
        self._processor = processor
        self._held: dict[str, _Held] = {}

    @classmethod
    def attach(cls, processor: OutputProcessor, vllm_config: VllmConfig) -> None:
        """Give ``processor`` its frontend when R3 is on."""
        if vllm_config.artifact_config.enable_routed_experts:
            processor.routed_experts = cls(processor)

    # ------------------------------------------------ the output processor
    def take_output(self, req_state: RequestState, output: EngineCoreOutput) -> bool:
        """Called first for each engine output of a live request: whether
        the output processor handles it. A held request's earlier outputs
        are dropped (their tokens lie past the frontend's end); its terminal
        one is rewritten into the frontend's finish (:meth:`_finish_held`).
        Sets the request's ``routed_experts_error``."""
        held = self._held.get(req_state.request_id)
        if held is not None:
            held.past += len(output.new_token_ids)
            if not output.finished:
                return False
            del self._held[req_state.request_id]
            _finish_held(held, output)
        if output.artifact_error is not None:
            req_state.routed_experts_error = output.artifact_error
        else:
            req_state.routed_experts_error = _routes_missing_reason(req_state, output)
        return True

    def at_stop_string(
        self, req_state: RequestState, output: EngineCoreOutput, stop: str, past: int
    ) -> tuple[FinishReason | None, str | None]:
        """The detokenizer found ``stop`` (``past`` tokens of ``output`` lie
        beyond it): the finish of a terminal output (a stop string whose
        routes failed is an error), else ``(None, None)`` and the request
        is held until the engine's terminal output, which the output
        processor asks for by aborting it."""
        from vllm.v1.engine import FinishReason

        if output.finished:
            ok = output.artifact_error is None
            return (FinishReason.STOP if ok else FinishReason.ERROR), stop
        self._held[req_state.request_id] = _Held(stop, past)
        return None, None

    def hold_abort(self, req_id: str, client_gone: bool) -> bool:
        """An explicit abort of ``req_id``: whether the request is kept until
        the engine's terminal output brings the routes of the tokens it
        returned (with a deadline). Not when its caller is gone, nor when it
        returned no token (it then ends saying why)."""
        processor = self._processor
        req_state = processor.request_states.get(req_id)
        if req_state is None or client_gone:
            self._held.pop(req_id, None)  # upstream's abort ends it now
            return False
        held = self._held.get(req_id)
        if held is None:
            detok = req_state.detokenizer
            if detok is None or detok.num_output_tokens() == 0:
                req_state.routed_experts_error = ABORTED_BEFORE_FIRST_TOKEN
                return False
            held = self._held[req_id] = _Held(None)
        if held.deadline is None:
            held.deadline = time.monotonic() + ABORT_WAIT_S
        # It stays known by its external id until its terminal output.
        mapped = processor.external_req_ids[req_state.external_req_id]
        if req_id not in mapped:
            mapped.append(req_id)
        return True

    # ------------------------------------------------ AsyncLLM, LLMEngine
    def engine_abort_items(self, req_ids: list[str]) -> list[Any]:
        """After ``OutputProcessor.abort_requests``: the ABORT payload for
        the engine. Only the requests held for their routes are sent as
        requests whose caller waits (their deadline is set; :meth:`expire`
        runs at it); the frontend already answered the others (a caller
        gone, or aborted before its first token), so the engine reads
        nothing for them even if a token was on its way."""
        held = [r for r in req_ids if r in self._held]
        kept = set(held)
        self._expire_later(held)
        return abort_items(held, True) + abort_items(
            [r for r in req_ids if r not in kept], False
        )

    def hold_stops(self, req_ids: list[str]) -> None:
        """``AsyncLLM``, after it sent the aborts of requests that ended at a
        stop string: each one held for its routes gets the abort's deadline
        (:meth:`expire` runs at it)."""
        deadline = time.monotonic() + ABORT_WAIT_S
        started = []
        for req_id in req_ids:
            held = self._held.get(req_id)
            if held is not None and held.deadline is None:
                held.deadline = deadline
                started.append(req_id)
        self._expire_later(started)

    def _expire_later(self, req_ids: list[str]) -> None:
        # Only AsyncLLM holds requests with a deadline: it runs in a loop.
        if req_ids:
            asyncio.get_running_loop().call_later(
                ABORT_WAIT_S + 0.1, self.expire, req_ids
            )

    def expire(self, req_ids: list[str]) -> None:
        """Finish the requests among ``req_ids`` still held past their
        deadline (the engine never answered): without routes, saying why,
        through the output processor's own path, as if the engine had sent
        that terminal output (an abort stays an abort; a stop string without
        routes is an error)."""
        from vllm.v1.engine import EngineCoreOutput, FinishReason

        now = time.monotonic()
        outputs = []
        for req_id in req_ids:
            held = self._held.get(req_id)
            if held is None or held.deadline is None or now < held.deadline:
                continue
            what = "abort" if held.stop is None else "stop string"
            error = ArtifactAbortTimeout(
                f"the engine sent no terminal output within {ABORT_WAIT_S:g} s "
                f"of the {what}, so the request carries no routes"
            )
            logger.error("request %s: %s", req_id, error)
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    [],
                    finish_reason=FinishReason.ABORT,
                    artifact_error=f"{type(error).__name__}: {error}",
                )
            )
        if outputs:
            self._processor.process_outputs(outputs)


def _routes_missing_reason(
    req_state: RequestState, output: EngineCoreOutput
) -> str | None:
    """The reason a terminal output without routes (and without the engine's
    own reason) gives: an abort by the engine (a pause, a shutdown) of a
    request that had returned no token. The request's reason otherwise."""
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


def _finish_held(held: _Held, output: EngineCoreOutput) -> None:
    """Rewrite the terminal output of a held request into the frontend's
    finish: no tokens, routes cut to the tokens returned."""
    from vllm.v1.engine import FinishReason

    output.new_token_ids = []
    output.new_logprobs = None
    output.new_sampling_mask = None
    if held.stop is None:  # an abort, routes or not
        output.finish_reason = FinishReason.ABORT
        output.stop_reason = None
    elif output.artifact_error is None and output.finish_reason != FinishReason.ERROR:
        output.finish_reason = FinishReason.STOP
        output.stop_reason = held.stop
    else:  # no routes: fail like any other finish whose routes failed
        if output.artifact_error is None:  # the engine failed it otherwise
            output.artifact_error = ENGINE_ERROR_WITHOUT_ROUTES
        output.finish_reason = FinishReason.ERROR
    # Every token the engine executed reached the frontend before this
    # output, so the routes end held.past rows after the returned tokens.
    if output.routed_experts is not None:
        keep = max(0, len(output.routed_experts) - held.past)
        output.routed_experts = output.routed_experts[:keep]
    ref = output.routed_experts_ref
    if ref is not None:  # the stored array stays whole; fetch returns these
        rows, layers, top_k = ref.shape
        output.routed_experts_ref = msgspec.structs.replace(
            ref, shape=(max(0, rows - held.past), layers, top_k)
        )


# ---------------------------------------------------------------- shutdown
def remove_dead_stores(
    vllm_config: VllmConfig, engine_manager: object = None, wait_s: float = 5.0
) -> None:
    """Called by the frontend once its engine processes are stopped. A
    shutdown may kill them before the worker removes its store (``vllm
    serve`` on SIGINT does): remove the stores under the root whose writer is
    proven dead, waiting up to ``wait_s`` for this engine's killed processes
    to be gone, and the root when that leaves it empty, then what they left
    in the scope of routed-experts references. Live engines' stores are
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
    # The engine manager's shutdown SIGKILLs what outlives its timeout (0 s
    # under ``vllm serve``'s default) without waiting: until an engine core
    # has exited it holds its reference scope and looks alive, and the scope
    # would be left behind (seen in CI after ``make demo``'s Ctrl-C).
    for proc in getattr(engine_manager, "processes", ()):
        proc.join(max(0.0, deadline - time.monotonic()))
    while True:
        try:
            report = collect_stale_stores(cfg.shm_root, cfg.inactive_ttl_s)
        except (ArtifactError, OSError) as e:
            logger.warning("could not clean up the artifact store root: %s", e)
            break
        if report.removed:
            logger.info("removed artifact stores of dead engines: %s", report.removed)
        if not ours & set(report.kept_alive) or time.monotonic() > deadline:
            with contextlib.suppress(OSError):
                os.rmdir(cfg.shm_root)
            break
        time.sleep(0.1)  # a killed worker is still exiting
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
