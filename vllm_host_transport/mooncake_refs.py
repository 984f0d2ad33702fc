# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The trainer's side of references over a Mooncake Store: range reads of
many references at once (:func:`read_ranges_many`), and letting go of one
(:func:`remove`, the driver's; :func:`mark_read`, each of N readers'), on
the process's clients (``mooncake_clients.py``).

Imported by the routes reader when a reference names
``transport="mooncake"``; needs neither vLLM nor torch (Mooncake's client
only). Calls on a joined client release the interpreter lock while they
wait (checked against a frozen master for every call used here), but wait
for Mooncake's own RPC timeouts: the range reads and releases run them on a
thread of their own and give up waiting at ``timeout_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_host_transport.mooncake_clients import (
    forget,
    joined,
    staging_put,
    staging_take,
)
from vllm_host_transport.mooncake_probe import describe_error
from vllm_host_transport.routed_experts import (
    RouteRefCorruptError,
    RouteRefInvalidError,
    RouteRefMissingError,
    RouteRefTransportError,
)

# ------------------------------------------------------------ range reads
#
# Measured on this project's 2-vCPU VM, mooncake-transfer-engine-non-cuda
# 0.3.13.post1, TCP on loopback, 64 objects of 1.5 MiB put by another
# process (best of 5):
#
# - get_into_ranges works into a buffer registered with register_buffer
#   (0.05 ms for 96 MiB, 0.01 ms for 4 KiB), and fails every range with
#   -600 into one that is not. batch_get_into_multi_buffer_ranges needs a
#   get session (batch_get_session_start/end) and was no faster.
# - 64 objects x 1 range of 768 KiB: 30 ms; x 12 ranges of 64 KiB (the
#   same 48 MiB): 75 ms; x 48 ranges of 16 KiB: 155 ms. Whole objects
#   (96 MiB, batch_get_into): 55-69 ms. A range costs about 50-60 us
#   beyond its bytes. Through read_ranges_many, 64 x 12 ranges 32 KiB
#   apart read as one span each: 65 ms, as 768 ranges: 113 ms; 64 KiB
#   apart: 134 ms as spans, 102 ms as ranges (best of 6, a shared VM):
#   ranges of one object at most MERGE_GAP_BYTES apart are read as one.
#   One object per reference and layer instead (768 x 64 KiB with
#   batch_get_into): 46 ms, no better than ranges, and 13 objects per
#   reference for the engine to put and the master to track.
# - Every call used here releases the interpreter lock, and waits while
#   the master is frozen until it resumes.
#
# So each read goes into a staging buffer of this module's (registered once
# per client, kept for the next read) on a thread of its own, and is copied
# into the caller's arrays only once it completed: a read that overran
# timeout_s is left to finish into memory nobody else uses (Mooncake's calls
# cannot be cancelled), and a failed read leaves the caller's arrays as
# they were.

#: Ranges of one object whose gap is at most this are read as one.
MERGE_GAP_BYTES = 32 << 10
#: Staging buffers kept per client between reads, and the largest kept.
_ALIGN = 64
_RPC_ERRORS = (-900, -901)  # the master did not answer: no fresh client
_OBJECT_NOT_FOUND = -704
_OBJECT_EXISTS = -705

#: One reference's read: its key, its object's size, and (byte offset in the
#: object, uint8 destination) pairs.
RangeRead = tuple[str, int, Sequence[tuple[int, np.ndarray]]]


@dataclass(slots=True)
class _Span:
    """One range read from an object, into ``stage`` of the staging buffer,
    that fills ``dsts`` (offset in the object, flat destination)."""

    start: int
    end: int
    stage: int = 0
    dsts: list[tuple[int, np.ndarray]] = field(default_factory=list)


def read_ranges(
    location: str,
    key: str,
    object_nbytes: int,
    ranges: Sequence[tuple[int, np.ndarray]],
    timeout_s: float,
) -> None:
    """Fill each uint8 array of ``ranges`` from its byte offset in object
    ``key`` (``object_nbytes`` long) of the Mooncake Store of master
    ``location``. See :func:`read_ranges_many`."""
    read_ranges_many(location, [(key, object_nbytes, ranges)], timeout_s)


def read_ranges_many(
    location: str, reads: Sequence[RangeRead], timeout_s: float
) -> None:
    """Fill every destination of ``reads`` (``(key, object_nbytes, [(offset,
    uint8 array), ...])``) from its object, all in one request to the master
    and one ranged get. Raises :class:`RouteRefMissingError` at once when an
    object is not there, :class:`RouteRefCorruptError` when one's size is not
    ``object_nbytes``, :class:`RouteRefTransportError` when the master cannot
    be joined or does not answer within ``timeout_s`` (the whole call), and
    :class:`RouteRefInvalidError` for a range outside its object or a
    destination that is not a writable contiguous uint8 array. On any error
    no destination was written. Bytes are not verified (the caller checks
    the digests of what it read)."""
    spans, sizes = _plan(reads)
    if not spans:
        return
    deadline = time.monotonic() + timeout_s
    # A read that fails while the master says its objects are there is tried
    # once more on a fresh client (see mooncake_clients.forget). One the master
    # did not answer is not: a client reconnects to a restarted master on
    # its own, and joining a master that is down takes Mooncake over a
    # minute.
    for attempt in (1, 2):
        store = joined(location, max(deadline - time.monotonic(), 0.0))
        failed = _read_once(location, store, spans, sizes, deadline, timeout_s)
        if failed is None:
            return
        if attempt == 2 or failed.startswith("rpc:"):
            raise RouteRefTransportError(
                f"a range read from the Mooncake Store of master {location} "
                f"failed: {failed.removeprefix('rpc:')}"
                + (" (also on a fresh client)" if attempt == 2 else "")
            )
        forget(location, store)


def _read_once(
    location: str,
    store: Any,
    spans: dict[str, list[_Span]],
    sizes: dict[str, int],
    deadline: float,
    timeout_s: float,
) -> str | None:
    """One try of :func:`read_ranges_many`: ``None`` once the destinations
    are filled, else why not (``rpc:`` first when the master did not
    answer). Raises the errors a fresh client would not change."""
    nbytes = max(s.stage + s.end - s.start for v in spans.values() for s in v)

    def abandoned(result: tuple[str, Any, np.ndarray | None]) -> None:
        staging_put(location, store, result[2])

    call = _Call(lambda: _read(store, spans, sizes, nbytes), abandoned)
    if not call.wait(deadline - time.monotonic()):
        raise _silent(location, timeout_s)
    if isinstance(call.error, RouteRefTransportError):
        raise call.error
    if call.error is not None:
        raise RouteRefTransportError(
            f"a range read from the Mooncake Store of master {location} "
            f"failed: {call.error!r}"
        ) from call.error
    what, answer, stage = call.result
    try:
        if what != "read":
            _raise_lookup(location, sizes, what, answer)
            return f"the master's answer to a lookup was {answer!r}"
        failed = _check_read(location, spans, answer)
        if failed is None:
            _copy_out(spans, stage)
        return failed
    finally:
        staging_put(location, store, stage)


def _plan(
    reads: Sequence[RangeRead],
) -> tuple[dict[str, list[_Span]], dict[str, int]]:
    """The spans to read, by key (staging offsets assigned), and each key's
    object size. Ranges of a key less than MERGE_GAP_BYTES apart (or
    overlapping) share a span."""
    by_key: dict[str, list[tuple[int, np.ndarray]]] = {}
    sizes: dict[str, int] = {}
    for key, object_nbytes, ranges in reads:
        if not isinstance(key, str) or not key:
            raise RouteRefInvalidError(f"a Mooncake key must be a string: {key!r}")
        if sizes.setdefault(key, object_nbytes) != object_nbytes:
            raise RouteRefInvalidError(
                f"routes {key} are named with two sizes: {sizes[key]} and "
                f"{object_nbytes}"
            )
        wanted = by_key.setdefault(key, [])
        for offset, dst in ranges:
            if (
                not isinstance(dst, np.ndarray)
                or dst.dtype != np.uint8
                or not dst.flags.c_contiguous
                or not dst.flags.writeable
            ):
                raise RouteRefInvalidError(
                    "a range's destination must be a writable C-contiguous uint8 array"
                )
            if not 0 <= offset <= offset + dst.nbytes <= object_nbytes:
                raise RouteRefInvalidError(
                    f"routes {key}: bytes [{offset}, {offset + dst.nbytes}) "
                    f"lie outside the {object_nbytes}-byte object"
                )
            if dst.nbytes:
                wanted.append((offset, dst.reshape(-1)))
    spans: dict[str, list[_Span]] = {}
    stage = 0
    for key, wanted in by_key.items():
        if not wanted:
            continue  # nothing to read (an empty object was never put)
        wanted.sort(key=lambda r: r[0])
        mine: list[_Span] = []
        for offset, dst in wanted:
            end = offset + dst.nbytes
            if mine and offset <= mine[-1].end + MERGE_GAP_BYTES:
                mine[-1].end = max(mine[-1].end, end)
            else:
                mine.append(_Span(offset, end))
            mine[-1].dsts.append((offset, dst))
        for span in mine:
            span.stage = stage
            stage += -(-(span.end - span.start) // _ALIGN) * _ALIGN
        spans[key] = mine
    return spans, {key: sizes[key] for key in spans}


def _read(
    store: Any, spans: dict[str, list[_Span]], sizes: dict[str, int], nbytes: int
) -> tuple[str, Any, np.ndarray | None]:
    """On the call's own thread: look the objects up, then read the spans
    into a staging buffer. Returns (what, its answer, the staging buffer)."""
    keys = list(spans)
    descs = store.batch_get_replica_desc(keys)
    found: dict[str, set[int]] = {}
    for key in keys:
        for replica in descs.get(key, ()):
            if replica.is_memory_replica():
                size = replica.get_memory_descriptor().buffer_descriptor.size
                found.setdefault(key, set()).add(int(size))
    absent = [k for k in keys if k not in found]
    if absent:
        # Not in the answer: gone, or the master could not say (an empty
        # answer either way); an existence query tells them apart.
        return "exists", dict(zip(absent, store.batch_is_exist(absent))), None
    wrong = {k: found[k] for k in keys if found[k] != {sizes[k]}}
    if wrong:
        return "sizes", wrong, None
    stage = staging_take(store, nbytes)
    try:
        answer = store.get_into_ranges(
            [stage.ctypes.data],
            [keys],
            [[[s.stage for s in spans[k]] for k in keys]],
            [[[s.start for s in spans[k]] for k in keys]],
            [[[s.end - s.start for s in spans[k]] for k in keys]],
        )
    except BaseException:
        store.unregister_buffer(stage.ctypes.data)  # dropped with the error
        raise
    return "read", answer, stage


def _raise_lookup(location: str, sizes: dict[str, int], what: str, answer) -> None:
    if what == "exists":
        gone = [k for k, rc in answer.items() if rc == 0]
        if gone:
            raise _missing(location, gone[0])
        # Absent from the replicas yet "there" (or the query failed): a
        # transport failure.
        return
    key, found = next(iter(answer.items()))
    raise RouteRefCorruptError(
        f"routes {key}: the Mooncake Store of master {location} holds "
        f"{' or '.join(map(str, sorted(found)))} bytes where the reference "
        f"names {sizes[key]}"
    )


def _check_read(location: str, spans: dict[str, list[_Span]], answer) -> str | None:
    """``None`` when every span read whole; else why not (prefixed ``rpc:``
    when the master did not answer). Raises for an object gone meanwhile."""
    if len(answer) != 1 or len(answer[0]) != len(spans):
        return f"get_into_ranges answered {answer!r}"
    for (key, mine), results in zip(spans.items(), answer[0]):
        if len(results) != len(mine):
            return f"get_into_ranges answered {results!r} for routes {key}"
        for span, rc in zip(mine, results):
            if rc == span.end - span.start:
                continue
            if rc == _OBJECT_NOT_FOUND:
                raise _missing(location, key)
            why = describe_error(rc) if rc < 0 else f"{rc} bytes read"
            return (
                f"{'rpc:' if rc in _RPC_ERRORS else ''}routes {key}, bytes "
                f"[{span.start}, {span.end}): {why}"
            )
    return None


def _copy_out(spans: dict[str, list[_Span]], stage: np.ndarray | None) -> None:
    assert stage is not None
    for mine in spans.values():
        for span in mine:
            for offset, dst in span.dsts:
                at = span.stage + offset - span.start
                dst[:] = stage[at : at + dst.nbytes]


class _Call:
    """``fn()`` on a thread of its own, waited for at most a deadline. A
    call given up on runs to its end all the same (Mooncake's calls cannot
    be cancelled); ``abandoned(result)`` then runs on its thread."""

    def __init__(
        self, fn: Callable[[], Any], abandoned: Callable[[Any], None] | None = None
    ) -> None:
        self._fn = fn
        self._abandoned_fn = abandoned
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._abandoned = False
        self.result: Any = None
        self.error: BaseException | None = None
        threading.Thread(target=self._run, name="mooncake-call", daemon=True).start()

    def _run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as e:  # handed to the waiter
            self.error = e
        with self._lock:
            self._done.set()
            abandoned = self._abandoned
        if abandoned and self._abandoned_fn is not None and self.error is None:
            self._abandoned_fn(self.result)

    def wait(self, timeout_s: float) -> bool:
        """Whether the call ended within ``timeout_s``."""
        if self._done.wait(max(timeout_s, 0.0)):
            return True
        with self._lock:
            if self._done.is_set():
                return True
            self._abandoned = True
            return False


def _bounded(location: str, timeout_s: float, what: str, fn: Callable[[Any], Any]):
    """``fn(client)`` on this process's client of ``location``, within
    ``timeout_s`` all told (the join included)."""
    deadline = time.monotonic() + timeout_s
    store = joined(location, timeout_s)
    call = _Call(lambda: fn(store))
    if not call.wait(deadline - time.monotonic()):
        raise _silent(location, timeout_s)
    if call.error is not None:
        raise RouteRefTransportError(
            f"{what} in the Mooncake Store of master {location} failed: {call.error}"
        ) from call.error
    return call.result


def _silent(location: str, timeout_s: float) -> RouteRefTransportError:
    return RouteRefTransportError(
        f"the Mooncake master {location} did not answer within {timeout_s:g} s "
        "(frozen, overloaded or unreachable)"
    )


def _missing(location: str, key: str) -> RouteRefMissingError:
    return RouteRefMissingError(
        f"routes {key} are not in the Mooncake Store of master {location}: "
        "released, retired with their weight version, removed after the "
        "engine's ref_ttl_s, evicted under memory pressure, or the engine "
        "stopped"
    )


# ------------------------------------------------------------ letting go


def remove(location: str, key: str, timeout_s: float) -> bool:
    """Remove object ``key`` now (the driver's release, once every reader
    read it). Returns whether this call removed it (``False``: gone
    already). Forced: every read leaves a lease on the object (10 s by
    default) that refuses a plain remove (measured: -706 right after a
    read); a reader still reading it fails with RouteRefMissingError, or
    reads bytes its digests reject (RouteRefCorruptError)."""
    rc = _bounded(
        location,
        timeout_s,
        f"removing routes {key}",
        lambda store: store.batch_remove([key], True),
    )[0]
    if rc in (0, _OBJECT_NOT_FOUND):
        return rc == 0
    raise RouteRefTransportError(
        f"the Mooncake Store of master {location} cannot remove routes {key}: "
        f"{describe_error(rc)}"
    )


def mark_read(
    location: str, key: str, reader: int, readers: int, timeout_s: float
) -> bool:
    """Reader ``reader`` of ``readers`` is done with object ``key``: it puts
    a marker object of its own (``<key>.read.<reader>.<readers>``), then
    asks whether the object and all ``readers`` markers are there; the
    reader that sees all of them removes the object and the markers (of two
    that see them at once, the one whose removal found the object). Returns
    whether this call removed the object.

    If the object goes first (its TTL, retired with its weight version,
    evicted, the engine stopped, or the driver's :func:`remove`), the
    markers put before stay until a later reader marks: one that finds the
    object gone removes all ``readers`` markers. The markers of readers
    that marked before a reader that never does stay in the store (a few
    bytes each, in whichever engine's segment the master placed them)
    until Mooncake evicts them or that engine stops."""
    if not 0 <= reader < readers:
        raise RouteRefInvalidError(f"reader must be in [0, {readers}), not {reader}")
    markers = [f"{key}.read.{i}.{readers}" for i in range(readers)]

    def mark(store: Any) -> bool | int:
        rc = store.put(markers[reader], b"\x01")
        if rc not in (0, _OBJECT_EXISTS):
            return rc
        there = store.batch_is_exist([key, *markers])
        if any(x < 0 for x in there):
            return min(there)
        if not there[0]:
            store.batch_remove(markers, True)
            return False
        if not all(there[1:]):
            return False
        return store.batch_remove([key, *markers], True)[0] == 0

    done = _bounded(location, timeout_s, f"marking routes {key} read", mark)
    if isinstance(done, bool):
        return done
    raise RouteRefTransportError(
        f"the Mooncake Store of master {location} cannot mark routes {key} "
        f"read: {describe_error(done)}"
    )
