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

Each attempt's cursors (rows end, committed end, its last page) live in
one slot of :class:`RowCursors`, arrays shared by all attempts, so that a
decode step places the rows of every running request with a few array
operations instead of a Python call per request (``write_step``).
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


# A handle is (generation << SLOT_BITS) | slot: rows prepared for an attempt
# whose slot was reused since are recognised as stale.
SLOT_BITS = 24
SLOT_MASK = (1 << SLOT_BITS) - 1


class RowCursors:
    """One slot per live attempt, as columns (engine side only):

    * ``handle``: the slot's current handle (-1: free);
    * ``end`` / ``committed``: the attempt's rows end and published end;
    * ``npages`` / ``tail_page``: how many pages it holds, and its last one
      (-1: none);
    * ``last_rows_end`` / ``last_sched_end``: where its last step's rows
      ended, and where that step's scheduled tokens ended (drafts included);
    * ``ending``: a finalize or a drain waits for its rows."""

    _COLUMNS = (
        ("handle", np.int64, -1),
        ("end", np.int64, 0),
        ("committed", np.int64, 0),
        ("npages", np.int64, 0),
        ("tail_page", np.int64, -1),
        ("last_rows_end", np.int64, -1),
        ("last_sched_end", np.int64, -1),
        ("ending", np.bool_, False),
    )

    def __init__(self, capacity: int = 64) -> None:
        self.handle = self.end = self.committed = self.npages = np.zeros(0, np.int64)
        self.tail_page = self.last_rows_end = self.last_sched_end = self.handle
        self.ending = np.zeros(0, np.bool_)
        self._free: list[int] = []
        self._generation = 0
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        old = self.handle.shape[0]
        for name, dtype, fill in self._COLUMNS:
            col = np.full(capacity, fill, dtype)
            col[:old] = getattr(self, name)
            setattr(self, name, col)
        self._free.extend(range(capacity - 1, old - 1, -1))

    def take(self, start_row: int) -> int:
        """A slot for a new attempt whose rows start at ``start_row``;
        returns its handle."""
        if not self._free:
            self._grow(2 * self.handle.shape[0])
        slot = self._free.pop()
        self._generation += 1
        handle = (self._generation << SLOT_BITS) | slot
        for name, _, fill in self._COLUMNS:
            getattr(self, name)[slot] = fill
        self.handle[slot] = handle
        self.end[slot] = self.committed[slot] = start_row
        return handle

    def give_back(self, handle: int) -> None:
        slot = handle & SLOT_MASK
        if self.handle[slot] == handle:
            self.handle[slot] = -1
            self._free.append(slot)

    def slots_of(self, handles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slots, whether each handle is still live)."""
        known = handles >= 0
        slots = np.where(known, handles & SLOT_MASK, 0)
        return slots, known & (self.handle[slots] == handles)


def as_row_cells(rows: np.ndarray) -> np.ndarray:
    """``rows`` (``[n, L, K]``) as ``n`` cells of one row's bytes each
    (copied only when not contiguous)."""
    rows = np.ascontiguousarray(rows)
    n = rows.shape[0]
    cell = np.dtype((np.void, rows.itemsize * int(np.prod(rows.shape[1:]))))
    return rows.reshape(n, -1).view(cell).reshape(n)


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
        # The same memory as one cell per row: scattering 256 rows of 384 B
        # into it took 4.1 us, against 15.8 us for a gather and a scatter
        # over ``pages``' trailing dimensions (docs/benchmarks.md, "The
        # rerun of issue 28's table").
        self.row_cells = as_row_cells(self.pages.reshape(-1, *spec.row_shape))
        self.cursors = RowCursors()
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
        gathered_pages: int = 0,
    ) -> RowSlab:
        """Sized for the worst case: each running request holds one partial
        page, and as many again for the attempts that wait with theirs (a
        preempted attempt until the resumed one has recomputed its rows, a
        finalize or a discard's drain until the rows of steps in flight
        arrive); each step in flight or queued for publication completes at
        most ``max_num_batched_tokens / B + max_num_seqs`` pages (a request's
        rows of one step can straddle one extra page); ``gathered_pages``
        full pages may wait for the next steps' before they are handed over."""
        per_step = -(-max_num_batched_tokens // block_size) + max_num_seqs
        return cls(
            spec,
            block_size,
            2 * max_num_seqs + steps_in_flight * per_step + gathered_pages,
        )

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
        return self.alloc_many(1, timeout_s)[0]

    def alloc_many(self, n: int, timeout_s: float = 0.0) -> list[int]:
        """``n`` free pages (see :meth:`alloc`)."""
        self._reclaim()
        deadline = time.monotonic() + timeout_s
        while len(self._free) < n and time.monotonic() < deadline:
            time.sleep(0.001)  # rare: the slab was sized for the worst case
            self._reclaim()
        if len(self._free) < n:
            raise RowBufferCapacityError(
                f"the artifact row buffer's {self.num_pages} pages are all in "
                "use: more rows are in flight than the scheduler limits allow "
                "for, or publication is not keeping up"
            )
        free = self._free
        taken = free[-n:]
        del free[-n:]
        return taken

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
        self._cur = slab.cursors
        self.handle = self._cur.take(start_row)
        self.slot = self.handle & SLOT_MASK
        self._pages: list[int] = []
        self._versions: list[str] = []

    @property
    def end(self) -> int:
        return self._cur.end.item(self.slot)

    @end.setter
    def end(self, value: int) -> None:
        self._cur.end[self.slot] = value

    @property
    def committed(self) -> int:
        return self._cur.committed.item(self.slot)

    @committed.setter
    def committed(self, value: int) -> None:
        self._cur.committed[self.slot] = value

    def _pages_changed(self) -> None:
        pages, slot = self._pages, self.slot
        self._cur.npages[slot] = len(pages)
        self._cur.tail_page[slot] = pages[-1] if pages else -1

    def append_page(self, page: int, weight_version: str) -> None:
        """Take ``page`` as the next page, for rows that start it (the
        caller updates the cursors' ``npages`` and ``tail_page``)."""
        self._pages.append(page)
        self._versions.append(weight_version)

    def release(self) -> None:
        """Give the attempt's cursor slot back (it left the publisher)."""
        self._cur.give_back(self.handle)

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
                self._pages_changed()
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
        self._pages_changed()
        self.end = end

    def take_blocks(
        self, hashes: dict[int, bytes]
    ) -> list[tuple[int, int, str, bytes]]:
        """Take every full page whose block hash is in ``hashes`` (block
        index -> hash; used hashes are removed), in order, stopping at the
        first block without one: ``(first row, page, weight version, hash)``
        each."""
        bs = self.slab.block_size
        out = []
        end, committed = self.end, self.committed
        while end - committed >= bs:
            h = hashes.pop(committed // bs, None)
            if h is None:
                break
            out.append((committed, self._pages.pop(0), self._versions.pop(0), h))
            committed += bs
        if out:
            self.committed = committed
            self._pages_changed()
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
        self._pages_changed()
        return row, page, num_rows - row, version

    def drop(self) -> None:
        """Return every page (abandoned or discarded attempt)."""
        for page in self._pages:
            self.slab.free(page)
        self._pages.clear()
        self._versions.clear()
        self._pages_changed()
        self.end = self.committed
