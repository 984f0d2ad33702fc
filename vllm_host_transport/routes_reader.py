# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Reading routes by reference: each trainer rank only its slice.

A reference (``routed_experts_ref``) names one stored object
(``routes_format.py``) that any number of processes read until it is
released. A rank asks for a token range and a layer selection and gets
exactly that, verified, in the dtype and buffer it replays from::

    from vllm_host_transport.routes_reader import read, read_batch, release

    # one reference: the MoE layers 12-23 of every row, as int64
    r = read(ref, layers=range(12, 24), dtype="int64")          # [T, 12, K]
    # a micro-batch: one padded [B, T_max, L, K] array, or packed
    routes, cu_seqlens = read_batch(refs, layers=mine, packed=True,
                                    layer_major=True, dtype=torch.int64)
    release(refs)                        # the driver, when every rank read
    release(refs, reader=rank, readers=world)   # or: the last rank removes

Only the bytes of the selected layers' rows are read (each widened to
whole digested chunks of ``block_rows`` rows), from the host transport of
the node (``readmany.py``: ``pread`` of a file in ``/dev/shm``) or from a
Mooncake Store (ranged gets, ``mooncake_refs.py``), the header and every
range of a batch in one pass. :func:`stats` counts the bytes read and the
bytes of the stored bodies not read.

Everything raised is a :class:`~.routed_experts.RouteRefError`: a bad
argument :class:`~.routed_experts.RouteRefInvalidError` (also a
``ValueError``), a released or expired payload
:class:`~.routed_experts.RouteRefMissingError` (at once), bytes that do not
match their digests :class:`~.routed_experts.RouteRefCorruptError`; ``out``
is left partly written only when an error is raised, never returned so.

torch is imported only when a ``dtype`` or ``out`` is a torch one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_host_transport.routed_experts import (
    RoutedExpertsRef,
    RouteRefCorruptError,
    RouteRefError,
    RouteRefInvalidError,
    RouteRefMissingError,
    RouteRefTransportError,
    as_ref,
)
from vllm_host_transport.routes_format import DIGESTS, decode_header, digest_bytes

#: The longest a read over Mooncake takes, joining the master included,
#: before it fails with RouteRefTransportError (a host read never waits).
DEFAULT_TIMEOUT_S = 10.0

Layers = Sequence[int] | range | slice | None
Tokens = slice | range | None

_stats_lock = threading.Lock()
_stats = {"refs_read": 0, "bytes_read": 0, "bytes_avoided": 0}


def stats() -> dict[str, int]:
    """This process's reads so far: references read, bytes read (headers
    included), and bytes of their stored bodies left unread."""
    with _stats_lock:
        return dict(_stats)


# ---------------------------------------------------------------- arguments
def _layer_list(layers: Layers, num_layers: int) -> list[int]:
    if layers is None:
        return list(range(num_layers))
    if isinstance(layers, slice):
        return list(range(num_layers))[layers]
    out = [int(x) for x in layers]
    bad = [x for x in out if not 0 <= x < num_layers]
    if bad:
        raise RouteRefInvalidError(
            f"layers {bad} are not in the routes' {num_layers} layers"
        )
    return out


def _token_range(tokens: Tokens, rows: int) -> tuple[int, int]:
    if tokens is None:
        return 0, rows
    if isinstance(tokens, range):
        tokens = slice(tokens.start, tokens.stop, tokens.step)
    if not isinstance(tokens, slice):
        raise RouteRefInvalidError("tokens must be a slice or a range of rows")
    start, stop, step = tokens.indices(rows)
    if step != 1:
        raise RouteRefInvalidError("tokens must be a contiguous range (step 1)")
    return start, max(start, stop)


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch dtypes imply torch
        raise RouteRefInvalidError(f"a torch dtype or out needs torch: {e}") from e
    return torch


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch")


def _np_dtype(dtype: Any) -> np.dtype:
    if _is_torch(dtype):
        return _torch().empty(0, dtype=dtype).numpy().dtype
    try:
        return np.dtype(dtype)
    except TypeError as e:
        raise RouteRefInvalidError(f"not a dtype: {dtype!r}") from e


def _target_dtype(dtype: Any, stored: np.dtype) -> np.dtype:
    if dtype is None:
        return stored
    target = _np_dtype(dtype)
    if target.kind not in "iu" or not np.can_cast(stored, target, "safe"):
        raise RouteRefInvalidError(
            f"routes stored as {stored} can be read as {stored} or a wider "
            f"integer dtype, not {target}"
        )
    return target


def _allocate(shape: tuple[int, ...], dtype: Any, target: np.dtype) -> Any:
    if dtype is not None and _is_torch(dtype):
        return _torch().empty(shape, dtype=dtype)
    return np.empty(shape, target)


def _host_view(out: Any, shape: tuple[int, ...], target: np.dtype) -> np.ndarray:
    """``out`` as a numpy array to write into, checked."""
    if _is_torch(out):
        if out.device.type != "cpu":
            raise RouteRefInvalidError(
                "out must be in host memory (a CPU tensor, pinned or not); "
                "copy it to the device after the read"
            )
        view = out.numpy()
    elif isinstance(out, np.ndarray):
        view = out
    else:
        raise RouteRefInvalidError("out must be a numpy array or a torch tensor")
    if view.shape != shape or view.dtype != target:
        raise RouteRefInvalidError(
            f"out must be {list(shape)} of {target}, not {list(view.shape)} "
            f"of {view.dtype}"
        )
    if not view.flags.writeable:
        raise RouteRefInvalidError("out is read-only")
    return view


# ---------------------------------------------------------------- the plan
@dataclass
class _Plan:
    """One reference's read: rows ``[t0, t1)`` of ``layers``, from stored
    rows ``[r0, r1)`` (whole chunks)."""

    ref: RoutedExpertsRef
    layers: list[int]
    t0: int
    t1: int
    r0: int = 0
    r1: int = 0
    header: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8))
    staged: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8))
    ranges: list[tuple[int, np.ndarray]] = field(default_factory=list)

    def build(self) -> None:
        ref = self.ref
        block = ref.block_rows
        stored = ref.stored_rows
        _, _, top_k = ref.shape
        row_nbytes = top_k * np.dtype(ref.dtype).itemsize
        self.header = np.empty(ref.header_nbytes, np.uint8)
        self.ranges = [(0, self.header)]
        if self.t1 <= self.t0 or not self.layers:
            self.r0 = self.r1 = self.t0
            return
        self.r0 = self.t0 // block * block
        self.r1 = min(-(-self.t1 // block) * block, stored)
        width = (self.r1 - self.r0) * row_nbytes
        self.staged = np.empty((len(self.layers), width), np.uint8)
        whole = self.r0 == 0 and self.r1 == stored
        j = 0
        while j < len(self.layers):
            k = j + 1
            # Consecutive layers read whole are one range of the body.
            while (
                whole
                and k < len(self.layers)
                and self.layers[k] == self.layers[k - 1] + 1
            ):
                k += 1
            offset = (
                ref.header_nbytes + (self.layers[j] * stored + self.r0) * row_nbytes
            )
            self.ranges.append((offset, self.staged[j:k].reshape(-1)))
            j = k

    @property
    def object_nbytes(self) -> int:
        return self.ref.header_nbytes + self.ref.nbytes

    @property
    def bytes_read(self) -> int:
        return self.header.nbytes + self.staged.nbytes

    def verify(self) -> np.ndarray:
        """Check the header against the reference and every staged chunk
        against the header; the selected rows as ``[layers, t1 - t0, K]``
        of the stored dtype."""
        ref = self.ref
        header_bytes = self.header.data
        if digest_bytes("xxh3_64", header_bytes).hex() != ref.checksum:
            raise RouteRefCorruptError(f"routes {ref.key}: header checksum mismatch")
        if ref.sha256 and digest_bytes("sha256", header_bytes).hex() != ref.sha256:
            raise RouteRefCorruptError(
                f"routes {ref.key}: header SHA-256 mismatch (the stored object "
                "was replaced)"
            )
        try:
            header = decode_header(header_bytes)
        except ValueError as e:
            raise RouteRefCorruptError(f"routes {ref.key}: {e}") from e
        _, layers, top_k = ref.shape
        want_digest = "sha256" if ref.transport == "mooncake" else "xxh3_64"
        if (
            header.stored_rows != ref.stored_rows
            or header.layers != layers
            or header.top_k != top_k
            or header.dtype != ref.dtype
            or header.block_rows != ref.block_rows
            or header.digest != want_digest
        ):
            raise RouteRefCorruptError(
                f"routes {ref.key}: the stored header does not describe the "
                "reference's routes"
            )
        dtype = np.dtype(ref.dtype)
        if not self.staged.size:
            return np.empty((len(self.layers), 0, top_k), dtype)
        size = DIGESTS[header.digest]
        chunk = ref.block_rows * top_k * dtype.itemsize
        blocks = header.blocks
        first = self.r0 // ref.block_rows
        digests = header.digests
        for j, layer in enumerate(self.layers):
            row = self.staged[j]
            for n, start in enumerate(range(0, row.size, chunk)):
                at = (layer * blocks + first + n) * size
                if (
                    digest_bytes(header.digest, row[start : start + chunk])
                    != (digests[at : at + size])
                ):
                    raise RouteRefCorruptError(
                        f"routes {ref.key}: layer {layer}, rows from "
                        f"{(first + n) * ref.block_rows}: digest mismatch"
                    )
        staged = self.staged.view(dtype).reshape(len(self.layers), -1, top_k)
        return staged[:, self.t0 - self.r0 : self.t1 - self.r0]


def _fetch(plans: list[_Plan], timeout_s: float) -> None:
    """Fill every plan's ranges from its transport."""
    host = [p for p in plans if p.ref.transport == "host"]
    for p in host:
        _fetch_host(p)
    by_master: dict[str, list[_Plan]] = {}
    for p in plans:
        if p.ref.transport == "mooncake":
            by_master.setdefault(p.ref.location, []).append(p)
    if by_master:
        from vllm_host_transport.mooncake_refs import read_ranges_many

        for master, group in by_master.items():
            read_ranges_many(
                master,
                [(p.ref.key, p.object_nbytes, p.ranges) for p in group],
                timeout_s,
            )


def _fetch_host(plan: _Plan) -> None:
    from vllm_host_transport.discovery import HostTransportError, ScopeMissingError
    from vllm_host_transport.readmany import ReadableMissingError, open_readable

    ref = plan.ref
    try:
        obj = open_readable(ref.location, ref.key)
    except ReadableMissingError:
        _collect_abandoned()
        raise _missing(ref) from None
    except ScopeMissingError:
        raise _missing(ref) from None
    except HostTransportError as e:
        raise RouteRefTransportError(
            f"host-transport scope {ref.location!r} cannot be used: {e}"
        ) from e
    except OSError as e:
        raise RouteRefTransportError(
            f"host-transport scope {ref.location!r} cannot be used: {e}"
        ) from e
    with obj:
        if obj.size != plan.object_nbytes:
            raise RouteRefCorruptError(
                f"routes {ref.key}: {obj.size} stored bytes where the reference "
                f"names {plan.object_nbytes}"
            )
        try:
            for offset, dst in plan.ranges:
                obj.read_into(offset, dst)
        except (HostTransportError, OSError) as e:
            raise RouteRefTransportError(f"routes {ref.key}: read failed: {e}") from e


def _collect_abandoned() -> None:
    """A reference that is gone may be one of a killed engine's (``open_readable``
    removes an object whose producer is proven dead): remove the scopes
    that no live connector holds, so a killed engine with no successor
    leaves nothing in ``/dev/shm`` once a trainer looked. A scandir of the
    root on this (rare) path only."""
    from vllm_host_transport.discovery import (
        HostTransportError,
        collect_abandoned_scopes,
    )

    with contextlib.suppress(HostTransportError, OSError):
        collect_abandoned_scopes()


def _missing(ref: RoutedExpertsRef) -> RouteRefMissingError:
    return RouteRefMissingError(
        f"routes {ref.key} are not in host-transport scope {ref.location!r}: "
        "released, retired with their weight version, removed after the "
        "engine's ref_ttl_s or ref_max_bytes, or the engine stopped"
    )


def _read_plans(plans: list[_Plan], timeout_s: float) -> list[np.ndarray]:
    _fetch(plans, timeout_s)
    got = [p.verify() for p in plans]
    read = sum(p.bytes_read for p in plans)
    body = sum(p.staged.nbytes for p in plans)
    with _stats_lock:
        _stats["refs_read"] += len(plans)
        _stats["bytes_read"] += read
        _stats["bytes_avoided"] += sum(p.ref.nbytes for p in plans) - body
    return got


def _refs(refs: Sequence[Any]) -> list[RoutedExpertsRef]:
    if isinstance(refs, str | bytes | dict | RoutedExpertsRef):
        raise RouteRefInvalidError("refs must be a sequence of references")
    return [as_ref(r) for r in refs]


# ---------------------------------------------------------------- the API
def read(
    ref: RoutedExpertsRef | dict[str, Any] | str,
    *,
    tokens: Tokens = None,
    layers: Layers = None,
    dtype: Any = None,
    out: Any = None,
    layer_major: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Any:
    """Rows ``tokens`` (of the reference's ``shape[0]``; row ``i`` is token
    ``prompt_start + i``) of ``layers`` (indices of the decoder-layer axis;
    ``routes_layers.py`` names a pipeline stage's MoE layers), as
    ``[tokens, layers, top_k]`` (``layer_major``: ``[layers, tokens,
    top_k]``) of ``dtype`` (the stored dtype, or any integer dtype that
    holds it: ``"int64"``/``torch.int64`` for replay), into ``out`` when
    given (a numpy array or a CPU torch tensor of that shape and dtype).
    Returns ``out``, or a new numpy array (a torch tensor when ``dtype`` is
    a torch dtype)."""
    got, _ = read_batch(
        [ref],
        tokens=tokens,
        layers=layers,
        dtype=dtype,
        out=None if out is None else _unsqueeze(out, layer_major),
        layer_major=layer_major,
        timeout_s=timeout_s,
        _single=True,
    )
    if out is not None:
        return out
    return got[0] if not layer_major else got[:, 0]


def _unsqueeze(out: Any, layer_major: bool) -> Any:
    if _is_torch(out):
        return out.unsqueeze(1 if layer_major else 0)
    if not isinstance(out, np.ndarray):
        raise RouteRefInvalidError("out must be a numpy array or a torch tensor")
    return out[:, None] if layer_major else out[None]


def read_batch(
    refs: Sequence[RoutedExpertsRef | dict[str, Any] | str],
    *,
    tokens: Tokens | Sequence[Tokens] = None,
    layers: Layers = None,
    dtype: Any = None,
    packed: bool = False,
    fill: int = 0,
    out: Any = None,
    layer_major: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    _single: bool = False,
) -> Any:
    """Many references in one call (one pass over each transport).

    ``tokens``: one range for every reference, or one per reference.
    Padded (default): ``[B, T_max, L, K]`` (``layer_major``: ``[L, B,
    T_max, K]``), rows past a reference's own length set to ``fill``; a
    padded batch returns ``(array, lengths)`` (int64 ``[B]``). Packed:
    ``[sum T, L, K]`` (``layer_major``: ``[L, sum T, K]``, so each layer's
    rows are one contiguous ``[sum T, K]`` block) and ``cu_seqlens``
    (int64 ``[B + 1]``); returns ``(array, cu_seqlens)``. Every reference
    must have the same layers, top-k and stored dtype."""
    parsed = _refs(refs)
    if not parsed:
        raise RouteRefInvalidError("refs is empty")
    _, num_layers, top_k = parsed[0].shape
    stored = np.dtype(parsed[0].dtype)
    for r in parsed[1:]:
        if r.shape[1:] != (num_layers, top_k) or np.dtype(r.dtype) != stored:
            raise RouteRefInvalidError(
                "a batch's references must share layers, top_k and dtype"
            )
    sel = _layer_list(layers, num_layers)
    target = _target_dtype(dtype, stored)
    if isinstance(tokens, Sequence) and not isinstance(tokens, range):
        if len(tokens) != len(parsed):
            raise RouteRefInvalidError(
                f"{len(tokens)} token ranges for {len(parsed)} references"
            )
        spans = [_token_range(t, r.shape[0]) for t, r in zip(tokens, parsed)]
    else:
        spans = [_token_range(tokens, r.shape[0]) for r in parsed]
    lengths = np.array([b - a for a, b in spans], np.int64)
    shape: tuple[int, ...]
    if packed:
        total = int(lengths.sum())
        shape = (len(sel), total, top_k) if layer_major else (total, len(sel), top_k)
    else:
        t_max = int(lengths.max(initial=0))
        shape = (
            (len(sel), len(parsed), t_max, top_k)
            if layer_major
            else (len(parsed), t_max, len(sel), top_k)
        )
        if np.array(fill).astype(target) != fill:
            raise RouteRefInvalidError(f"fill {fill} does not fit {target}")
    result = _allocate(shape, dtype, target) if out is None else out
    view = _host_view(result, shape, target)

    plans = [_Plan(r, sel, a, b) for r, (a, b) in zip(parsed, spans)]
    for p in plans:
        p.build()
    try:
        got = _read_plans(plans, timeout_s)
    except RouteRefError:
        raise
    except Exception as e:  # a transport's unexpected fault, typed
        raise RouteRefTransportError(f"reading routes failed: {e!r}") from e
    at = 0
    for b, rows in enumerate(got):  # rows: [L_sel, n, K]
        n = rows.shape[1]
        if packed:
            if layer_major:
                np.copyto(view[:, at : at + n], rows, casting="safe")
            else:
                np.copyto(view[at : at + n], rows.transpose(1, 0, 2), casting="safe")
            at += n
        elif layer_major:
            np.copyto(view[:, b, :n], rows, casting="safe")
            view[:, b, n:] = fill
        else:
            np.copyto(view[b, :n], rows.transpose(1, 0, 2), casting="safe")
            view[b, n:] = fill
    if _single:
        return result, None
    if packed:
        cu = np.zeros(len(parsed) + 1, np.int64)
        np.cumsum(lengths, out=cu[1:])
        return result, (_torch().from_numpy(cu) if _is_torch(result) else cu)
    return result, (_torch().from_numpy(lengths) if _is_torch(result) else lengths)


def release(
    refs: Sequence[RoutedExpertsRef | dict[str, Any] | str],
    *,
    reader: int | None = None,
    readers: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> int:
    """Let go of ``refs``. With neither ``reader`` nor ``readers`` (the
    driver, once every rank read): remove the payloads now. With both (rank
    ``reader`` of ``readers``): mark this rank done; the rank that completes
    the set removes the payload. Either way, reads after the removal raise
    :class:`RouteRefMissingError` at once; releasing a payload that is gone
    already is not an error. Returns how many payloads this call removed."""
    parsed = _refs(refs)
    if (reader is None) != (readers is None):
        raise RouteRefInvalidError("give both reader and readers, or neither")
    if readers is not None and not 0 <= reader < readers:  # type: ignore[operator]
        raise RouteRefInvalidError(f"reader must be in [0, {readers})")
    removed = 0
    for ref in parsed:
        if ref.transport == "mooncake":
            from vllm_host_transport import mooncake_refs

            if reader is None or readers is None:
                removed += mooncake_refs.remove(ref.location, ref.key, timeout_s)
            else:
                removed += mooncake_refs.mark_read(
                    ref.location, ref.key, reader, readers, timeout_s
                )
        else:
            removed += _release_host(ref, reader, readers)
    return removed


def _release_host(
    ref: RoutedExpertsRef, reader: int | None, readers: int | None
) -> bool:
    from vllm_host_transport.discovery import HostTransportError, ScopeMissingError
    from vllm_host_transport.readmany import (
        ReadableMissingError,
        open_readable,
        remove_readable,
    )

    try:
        if readers is None:
            return remove_readable(ref.location, ref.key)
        with open_readable(ref.location, ref.key) as obj:
            return obj.release(reader, readers)  # type: ignore[arg-type]
    except (ReadableMissingError, ScopeMissingError):
        return False
    except ValueError as e:
        raise RouteRefInvalidError(str(e)) from e
    except HostTransportError as e:
        raise RouteRefTransportError(
            f"host-transport scope {ref.location!r} cannot be used: {e}"
        ) from e
