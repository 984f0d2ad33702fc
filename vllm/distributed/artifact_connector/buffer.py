# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker's row buffer: unpublished rows of every running attempt.

All rows live in one slab allocated at start-up (:class:`RowSlab`), cut into
pages of one hash block each. An attempt's rows (:class:`AttemptRows`) are
indexed by logical token position, never by KV slot or block id: page ``i``
of an attempt holds rows ``[committed + i*B, committed + (i+1)*B)``. A full
page *is* a block's payload: publication takes the page itself (no copy)
and returns it to the slab once the object is in the store.

The slab is sized from the scheduler's limits, so memory is bounded and
known at start-up: one partial page per running request plus the pages of
the steps that can be in flight or queued for publication.
"""

from __future__ import annotations

import collections
import time

import numpy as np

from vllm.distributed.artifact_connector.store import ArtifactError
from vllm.utils.routed_experts_rows import RowSpec


class RowBufferError(ArtifactError):
    """Base class of row buffer failures."""


class RowGapError(RowBufferError):
    """Rows would leave a hole (a write past the end, a finalize past the
    rows received)."""


class RowOverlapError(RowBufferError):
    """Rows overlap rows already handed to publication."""


class RowBufferCapacityError(RowBufferError):
    """The slab has no free page (more rows in flight than it was sized
    for)."""


# How long a write waits for the publication thread to return a page before
# the slab counts as exhausted (back-pressure, not a normal wait).
PAGE_WAIT_S = 2.0


class RowSlab:
    """``num_pages`` pages of ``[block_size, L, K]`` rows in one array.

    Pages are taken and returned on the engine's thread; the publication
    thread hands pages back through :meth:`free_later` (thread-safe), and
    they are reclaimed at the next :meth:`alloc`."""

    def __init__(self, spec: RowSpec, block_size: int, num_pages: int) -> None:
        if block_size <= 0 or num_pages <= 0:
            raise ValueError("block_size and num_pages must be positive")
        self.spec = spec
        self.block_size = block_size
        self.pages = np.zeros((num_pages, block_size, *spec.row_shape), spec.dtype)
        self._free = list(range(num_pages - 1, -1, -1))
        self._returned: collections.deque[int] = collections.deque()

    @classmethod
    def for_scheduler(
        cls,
        spec: RowSpec,
        block_size: int,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        steps_in_flight: int,
    ) -> RowSlab:
        """Sized for the worst case: each running request holds one partial
        page, and as many again for the attempts that wait with theirs (a
        preempted attempt until the resumed one has recomputed its rows, a
        finalize or a discard's drain until the rows of steps in flight
        arrive); each step in flight or queued for publication completes at
        most ``max_num_batched_tokens / B + max_num_seqs`` pages (a request's
        rows of one step can straddle one extra page)."""
        per_step = -(-max_num_batched_tokens // block_size) + max_num_seqs
        return cls(spec, block_size, 2 * max_num_seqs + steps_in_flight * per_step)

    @property
    def num_pages(self) -> int:
        return self.pages.shape[0]

    @property
    def nbytes(self) -> int:
        return self.pages.nbytes

    def num_free(self) -> int:
        self._reclaim()
        return len(self._free)

    def _reclaim(self) -> None:
        ret = self._returned
        while ret:
            self._free.append(ret.popleft())

    def alloc(self, timeout_s: float = 0.0) -> int:
        """A free page; waits up to ``timeout_s`` for the publication thread
        to return one, then raises :class:`RowBufferCapacityError`."""
        self._reclaim()
        deadline = time.monotonic() + timeout_s
        while not self._free and time.monotonic() < deadline:
            time.sleep(0.001)  # rare: the slab was sized for the worst case
            self._reclaim()
        if not self._free:
            raise RowBufferCapacityError(
                f"the artifact row buffer's {self.num_pages} pages are all in "
                "use: more rows are in flight than the scheduler limits allow "
                "for, or publication is not keeping up"
            )
        return self._free.pop()

    def free(self, page: int) -> None:
        self._free.append(page)

    def free_later(self, pages: list[int]) -> None:
        """Return pages from another thread."""
        self._returned.extend(pages)


class AttemptRows:
    """Unpublished rows ``[committed, end)`` of one attempt, in slab pages.

    * It starts at the attempt's cached length (a block boundary).
    * A write at a position below ``end`` replaces the rows from there on
      (a rejected asynchronous suffix); a write past ``end`` is a gap.
    * :meth:`take_blocks` hands full pages to publication and
      advances ``committed``; rows below ``committed`` can no longer change.
    * Each page remembers the weight version of its first row: a block that
      straddles a weight update is keyed with the older version, so a later
      prefix hit under the newer weights fails loudly instead of reusing it.
    """

    def __init__(self, slab: RowSlab, start_row: int) -> None:
        bs = slab.block_size
        if start_row < 0 or start_row % bs:
            raise RowOverlapError(
                f"an attempt's cached start must be a multiple of the hash "
                f"block size {bs}, got {start_row}"
            )
        self.slab = slab
        self.start_row = start_row
        self.committed = start_row
        self.end = start_row
        self._pages: list[int] = []
        self._versions: list[str] = []

    def place(
        self, start: int, num_rows: int, weight_version: str
    ) -> list[tuple[int, int, int]]:
        """Make room for rows ``[start, start + num_rows)`` (replacing held
        rows from ``start`` on) and return where they go: ``(page, row in
        page, count)`` pieces. The caller copies the rows there."""
        if start != self.end:
            if start > self.end:
                raise RowGapError(
                    f"rows for tokens [{start}, {start + num_rows}) leave a gap "
                    f"after row {self.end}"
                )
            if start < self.committed:
                raise RowOverlapError(
                    f"rows for tokens from {start} overlap rows up to "
                    f"{self.committed} that are already being published"
                )
            self._truncate(start)
        bs = self.slab.block_size
        pages = self._pages
        pieces = []
        pos, end = start, start + num_rows
        while pos < end:
            page_idx, off = divmod(pos - self.committed, bs)
            if page_idx == len(pages):
                pages.append(self.slab.alloc(PAGE_WAIT_S))
                self._versions.append(weight_version)
            take = min(bs - off, end - pos)
            pieces.append((pages[page_idx], off, take))
            pos += take
        self.end = end
        return pieces

    def _truncate(self, end: int) -> None:
        keep = -(-(end - self.committed) // self.slab.block_size)
        while len(self._pages) > keep:
            self.slab.free(self._pages.pop())
            self._versions.pop()
        self.end = end

    def place_one(self, row: int, weight_version: str) -> int:
        """:meth:`place` for one row (a decode step): its index in the slab
        viewed as ``[num_pages * block_size, L, K]`` rows."""
        bs = self.slab.block_size
        k = row - self.committed
        if row == self.end and k < len(self._pages) * bs:  # room in the last page
            self.end = row + 1
            return self._pages[k // bs] * bs + k % bs
        ((page, off, _),) = self.place(row, 1, weight_version)
        return page * bs + off

    def take_blocks(
        self, hashes: dict[int, bytes]
    ) -> list[tuple[int, int, str, bytes]]:
        """Take every full page whose block hash is in ``hashes`` (block
        index -> hash; used hashes are removed), in order, stopping at the
        first block without one: ``(first row, page, weight version, hash)``
        each."""
        bs = self.slab.block_size
        out = []
        while self.end - self.committed >= bs:
            h = hashes.pop(self.committed // bs, None)
            if h is None:
                break
            out.append((self.committed, self._pages.pop(0), self._versions.pop(0), h))
            self.committed += bs
        return out

    def take_tail(self, num_rows: int) -> tuple[int, int, int, str] | None:
        """Cut the attempt at ``num_rows`` (dropping rows past it) and hand
        over the partial last page: ``(first row, page, rows, weight
        version)``, or ``None`` when ``num_rows`` is on the committed
        boundary. Full blocks must have been taken first."""
        if num_rows > self.end:
            raise RowGapError(
                f"request finalised at {num_rows} rows but rows end at {self.end}"
            )
        if num_rows < self.committed:
            raise RowOverlapError(
                f"request finalised at {num_rows} rows but {self.committed} rows "
                "are already published"
            )
        if num_rows - self.committed >= self.slab.block_size:
            raise RowGapError("take the full blocks before the tail")
        self._truncate(num_rows)
        if num_rows == self.committed:
            return None
        row = self.committed
        self.committed = num_rows
        page, version = self._pages.pop(0), self._versions.pop(0)
        return row, page, num_rows - row, version

    def drop(self) -> None:
        """Return every page (abandoned or discarded attempt)."""
        for page in self._pages:
            self.slab.free(page)
        self._pages.clear()
        self._versions.clear()
        self.end = self.committed
