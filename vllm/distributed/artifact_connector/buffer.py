# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker's logical per-request row buffer.

Holds only *uncommitted* rows of one request attempt, indexed by logical
token position (never by KV slot or block id):

* it starts at the request's cached length (a hash-block boundary);
* a write at a position below the current end replaces everything from that
  position on (recomputation after preemption, a rejected asynchronous
  suffix); a write beyond the end is a gap and is rejected;
* full blocks are handed out for publication (:meth:`ready_blocks`) and
  released once published (:meth:`release`); a recomputation may restart
  below the committed boundary only on a block boundary, after which those
  blocks are published again;
* memory is bounded by ``max_rows`` uncommitted rows.
"""

from __future__ import annotations

import numpy as np

from vllm.distributed.artifact_connector.request_core import RowSpec
from vllm.distributed.artifact_connector.store import ArtifactError


class RowBufferError(ArtifactError):
    """Base class of row buffer failures."""


class RowGapError(RowBufferError):
    """Rows would leave a hole (write past the end, finalize past the end)."""


class RowOverlapError(RowBufferError):
    """Rows overlap committed rows in a way that cannot be replayed."""


class RowBufferCapacityError(RowBufferError):
    """More uncommitted rows than the per-request bound."""


class RequestRowBuffer:
    """Uncommitted rows ``[committed, end)`` of one request attempt."""

    def __init__(
        self,
        spec: RowSpec,
        block_size: int,
        start_row: int = 0,
        *,
        max_rows: int = 1 << 16,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if start_row < 0 or start_row % block_size:
            raise RowOverlapError(
                f"a request's cached start must be a multiple of the hash block "
                f"size {block_size}, got {start_row}"
            )
        if max_rows < block_size:
            raise ValueError("max_rows must hold at least one block")
        self.spec = spec
        self.block_size = block_size
        self.start_row = start_row
        self.max_rows = max_rows
        self._base = start_row
        self._len = 0
        self._rows = np.empty(
            (min(max_rows, 4 * block_size), *spec.row_shape), spec.dtype
        )

    @property
    def committed(self) -> int:
        """Rows below this position were released (published)."""
        return self._base

    @property
    def end(self) -> int:
        """One past the last row held."""
        return self._base + self._len

    @property
    def num_rows_held(self) -> int:
        return self._len

    @property
    def nbytes_reserved(self) -> int:
        return self._rows.nbytes

    def write(self, start: int, rows: np.ndarray) -> None:
        """Store rows for tokens ``[start, start + len(rows))``, replacing any
        held rows from ``start`` on."""
        self.spec.check_rows(rows)
        if start < 0:
            raise RowGapError(f"negative row position {start}")
        if start > self.end:
            raise RowGapError(
                f"rows for tokens [{start}, {start + len(rows)}) leave a gap after "
                f"row {self.end}"
            )
        if start < self._base:
            if start % self.block_size:
                raise RowOverlapError(
                    f"recomputed rows start at {start}, inside already committed "
                    f"rows [.., {self._base}) and not on a block boundary "
                    f"({self.block_size})"
                )
            self._base = start
            self._len = 0
        else:
            self._len = start - self._base
        n = rows.shape[0]
        need = self._len + n
        if need > self.max_rows:
            raise RowBufferCapacityError(
                f"request holds {need} uncommitted rows, more than the bound of "
                f"{self.max_rows}; block hashes are not arriving to commit them"
            )
        if need > self._rows.shape[0]:
            cap = min(self.max_rows, max(need, 2 * self._rows.shape[0]))
            grown = np.empty((cap, *self.spec.row_shape), self.spec.dtype)
            grown[: self._len] = self._rows[: self._len]
            self._rows = grown
        self._rows[self._len : need] = rows
        self._len = need

    def truncate(self, end: int) -> None:
        """Drop rows at and after ``end`` (rejected suffix)."""
        if end < self._base:
            raise RowOverlapError(
                f"cannot truncate to row {end}: rows up to {self._base} are "
                "already committed"
            )
        self._len = min(self._len, end - self._base)

    def ready_blocks(self, limit_row: int | None = None) -> tuple[int, np.ndarray]:
        """Full blocks held from ``committed``, ending at or before
        ``limit_row`` (e.g. rows whose block hashes are known). Returns the
        first row and a read-only *view* ``[k * block_size, L, K]``; call
        :meth:`release` after publishing."""
        end = self.end if limit_row is None else min(self.end, limit_row)
        k = max(0, (end - self._base) // self.block_size)
        view = self._rows[: k * self.block_size]
        view.flags.writeable = False
        return self._base, view

    def rows(self, start: int, end: int) -> np.ndarray:
        """A view of held rows ``[start, end)``."""
        if start < self._base or end > self.end or start > end:
            raise RowGapError(
                f"rows [{start}, {end}) are not held (held [{self._base}, {self.end}))"
            )
        view = self._rows[start - self._base : end - self._base]
        view.flags.writeable = False
        return view

    def release(self, upto_row: int) -> None:
        """Forget rows below ``upto_row`` (a block boundary, after they were
        published)."""
        if upto_row % self.block_size and upto_row != self.end:
            raise RowOverlapError(f"release point {upto_row} is not block aligned")
        if upto_row < self._base or upto_row > self.end:
            raise RowGapError(
                f"cannot release up to row {upto_row}: held rows are "
                f"[{self._base}, {self.end})"
            )
        k = upto_row - self._base
        rem = self._len - k
        self._rows.flags.writeable = True
        if rem and k:
            self._rows[:rem] = self._rows[k : k + rem].copy()
        self._base = upto_row
        self._len = rem

    def finalize(self, num_rows: int) -> tuple[int, np.ndarray]:
        """Cut the buffer at the request's final row count and return
        ``(first_row, rows)`` still to publish (full blocks plus tail)."""
        if num_rows < self._base:
            raise RowOverlapError(
                f"request finalised at {num_rows} rows but {self._base} rows are "
                "already committed"
            )
        if num_rows > self.end:
            raise RowGapError(
                f"request finalised at {num_rows} rows but rows end at {self.end}"
            )
        self._len = num_rows - self._base
        return self._base, self.rows(self._base, num_rows)
