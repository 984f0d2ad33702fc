# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A trainer rank's routes in the form megatron-core's router replay takes.

megatron-core (0.16.1, ``moe_enable_routing_replay=True``) creates one
``RouterReplay`` per MoE router of the rank, in layer order, and
``RouterReplay.set_replay_data(tensors)`` hands router ``i`` the int64
``[local_tokens, top_k]`` tensor ``tensors[i]``. A router sees its tokens
flattened from the hidden states' ``[s, b]`` (``TopKRouter.routing``:
``logits.view(-1, num_experts)``), after context parallelism (each CP rank
keeps chunks ``r`` and ``2 * cp - 1 - r`` of every sequence) and sequence
parallelism (each TP rank keeps one contiguous part). This module builds
that list from a micro-batch of references::

    from megatron.core.transformer.moe.router_replay import RouterReplay
    from vllm_host_transport.megatron_replay import replay_inputs
    from vllm_host_transport.routes_layers import moe_layers_of_stage

    layers = moe_layers_of_stage(hf_config, pp_rank, pp_size)
    RouterReplay.set_replay_data(replay_inputs(refs, layers, seq_align=tp))

Token layout (``layout``):

- ``"thd"`` (packed, what verl, slime, NeMo-RL and SkyRL replay with):
  sequence after sequence, each padded to a multiple of ``seq_align``
  (verl: ``tp``, or ``2 * tp * cp`` with CP; slime: 1), then the whole
  micro-batch to a multiple of ``total_align`` (slime: ``tp *
  data_pad_size_multiplier``).
- ``"sbhd"`` (padded ``[s, b]``): every sequence padded to ``seq_length``
  (default: the longest, rounded up to ``seq_align``), tokens in ``s``-major
  order as the router flattens them.

Rows: token ``t`` of a sequence replays the reference's row ``t``. The
last token of prompt + completion has no row (it was sampled, never fed to
the engine); it replays the row before it (its routing changes only its own
output, which a next-token loss does not use). A padding position replays
experts ``0 .. top_k - 1``: valid and distinct, so Megatron's dropless
dispatch still sends each token to exactly ``top_k`` experts; mask padding
out of the loss (and of the aux loss through ``padding_mask``) as usual.

Only the rows this rank's tokens need are read (one ``read_batch`` of the
rank's MoE layers, ``packed`` and ``layer_major``, as int64), then gathered
into one ``[layers, local_tokens, top_k]`` tensor: ``tensors[i]`` is its
contiguous ``[local_tokens, top_k]`` slice. torch is imported when called.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm_host_transport.routed_experts import RouteRefInvalidError, as_ref
from vllm_host_transport.routes_reader import DEFAULT_TIMEOUT_S, read_batch

PAD = -1
"""Position of a padding token in :func:`token_rows`' answer."""

LAYOUTS = ("thd", "sbhd")


def _cp_positions(length: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Positions ``0 .. length`` that CP rank ``cp_rank`` keeps: chunks
    ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``."""
    if cp_size == 1:
        return np.arange(length, dtype=np.int64)
    chunk = length // (2 * cp_size)
    first = np.arange(cp_rank * chunk, (cp_rank + 1) * chunk, dtype=np.int64)
    back = 2 * cp_size - 1 - cp_rank
    second = np.arange(back * chunk, (back + 1) * chunk, dtype=np.int64)
    return np.concatenate([first, second])


def token_rows(
    rows: Sequence[int],
    seq_lens: Sequence[int] | None = None,
    *,
    layout: str = "thd",
    seq_align: int = 1,
    total_align: int = 1,
    seq_length: int | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    sp_size: int = 1,
    sp_rank: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """For each token a rank's routers see, in their order: which sequence
    it belongs to and which row of that sequence's routes it replays
    (:data:`PAD` for padding). ``rows[i]`` is reference ``i``'s row count,
    ``seq_lens[i]`` the tokens of sequence ``i`` in the trainer (default
    ``rows[i] + 1``: prompt plus completion). Returns ``(seq, row)``, two
    int64 arrays of the rank's token count."""
    if layout not in LAYOUTS:
        raise RouteRefInvalidError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    for name, size, rank in (("cp", cp_size, cp_rank), ("sp", sp_size, sp_rank)):
        if size < 1 or not 0 <= rank < size:
            raise RouteRefInvalidError(f"{name}_rank {rank} is not in 0..{size - 1}")
    if seq_align < 1 or total_align < 1:
        raise RouteRefInvalidError("seq_align and total_align must be >= 1")
    rows = [int(r) for r in rows]
    lens = [r + 1 for r in rows] if seq_lens is None else [int(n) for n in seq_lens]
    if len(lens) != len(rows):
        raise RouteRefInvalidError(f"{len(lens)} seq_lens for {len(rows)} references")
    for i, (n, r) in enumerate(zip(lens, rows)):
        if not 0 <= n <= r + 1:
            raise RouteRefInvalidError(
                f"sequence {i} has {n} tokens but its routes have {r} rows; "
                f"they cover at most {r + 1} tokens (ask for the routes with "
                "routed_experts_prompt_start=0)"
            )
    # A CP rank keeps two chunks of 2 * cp of every sequence.
    align = math.lcm(seq_align, 2 * cp_size) if cp_size > 1 else seq_align

    def row_of(i: int, t: np.ndarray) -> np.ndarray:
        # The last token (no row of its own) replays the row before it.
        out = np.minimum(t, rows[i] - 1)
        out[(t >= lens[i]) | (out < 0)] = PAD
        return out

    seqs: list[np.ndarray] = []
    picked: list[np.ndarray] = []
    if layout == "thd":
        for i, n in enumerate(lens):
            padded = -(-n // align) * align
            t = _cp_positions(padded, cp_size, cp_rank)
            seqs.append(np.full(len(t), i, np.int64))
            picked.append(row_of(i, t))
        seq = np.concatenate(seqs) if seqs else np.empty(0, np.int64)
        row = np.concatenate(picked) if picked else np.empty(0, np.int64)
        extra = -len(seq) % total_align
        seq = np.concatenate([seq, np.full(extra, PAD, np.int64)])
        row = np.concatenate([row, np.full(extra, PAD, np.int64)])
    else:
        s = max(lens, default=0) if seq_length is None else int(seq_length)
        if s < max(lens, default=0):
            raise RouteRefInvalidError(f"seq_length {s} < longest sequence")
        s = -(-s // align) * align
        t = _cp_positions(s, cp_size, cp_rank)
        if len(t) % sp_size:  # sequence parallelism splits the s axis
            raise RouteRefInvalidError(
                f"s = {len(t)} does not split over {sp_size} sequence-parallel ranks"
            )
        batch = len(lens)
        # [s, b] flattened s-major: position p of sequence b at p * batch + b.
        seq = np.tile(np.arange(batch, dtype=np.int64), len(t))
        pos = np.repeat(t, batch)
        row = np.full(len(pos), PAD, np.int64)
        for i in range(batch):
            mine = seq == i
            row[mine] = row_of(i, pos[mine])
    if len(seq) % sp_size:
        raise RouteRefInvalidError(
            f"{len(seq)} tokens do not split over {sp_size} sequence-parallel "
            "ranks: raise seq_align or total_align to a multiple of it"
        )
    part = len(seq) // sp_size
    keep = slice(sp_rank * part, (sp_rank + 1) * part)
    return seq[keep].copy(), row[keep].copy()


def replay_inputs(
    refs: Sequence[Any],
    layers: Sequence[int],
    *,
    seq_lens: Sequence[int] | None = None,
    layout: str = "thd",
    seq_align: int = 1,
    total_align: int = 1,
    seq_length: int | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    sp_size: int = 1,
    sp_rank: int = 0,
    device: Any = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """``RouterReplay.set_replay_data``'s argument for one micro-batch.

    ``refs``: the micro-batch's references, in the trainer's sequence
    order; ``layers``: the MoE layers of this rank, in router order
    (``routes_layers.moe_layers_of_stage``). ``sp_size``/``sp_rank``: the
    tensor-parallel size and rank with sequence parallelism on (else 1 and
    0). The other arguments as in :func:`token_rows`. Returns one int64
    ``[local_tokens, top_k]`` tensor per layer (views of one contiguous
    ``[layers, local_tokens, top_k]`` tensor), on ``device`` (default CPU;
    ``RouterReplay`` moves them to the scores' device itself).

    Raises what ``routes_reader.read_batch`` raises (``RouteRefError``s) and
    :class:`RouteRefInvalidError` for a layout the arguments cannot make.
    """
    import torch

    parsed = [as_ref(r) for r in refs]
    if not parsed:
        raise RouteRefInvalidError("refs is empty")
    starts = [r.prompt_start for r in parsed if r.prompt_start]
    if starts:
        raise RouteRefInvalidError(
            "references must cover their sequences from the first token "
            f"(routed_experts_prompt_start=0); got prompt_start {starts[0]}"
        )
    top_k = parsed[0].shape[2]
    seq, row = token_rows(
        [r.shape[0] for r in parsed],
        seq_lens,
        layout=layout,
        seq_align=seq_align,
        total_align=total_align,
        seq_length=seq_length,
        cp_size=cp_size,
        cp_rank=cp_rank,
        sp_size=sp_size,
        sp_rank=sp_rank,
    )
    real = row != PAD
    # Read of each reference only the rows this rank replays.
    lo = np.zeros(len(parsed), np.int64)
    hi = np.zeros(len(parsed), np.int64)
    for i in range(len(parsed)):
        used = row[real & (seq == i)]
        if len(used):
            lo[i], hi[i] = used.min(), used.max() + 1
    layers = list(layers)
    if real.any() and layers:
        src, cu = read_batch(
            parsed,
            tokens=[slice(int(a), int(b)) for a, b in zip(lo, hi)],
            layers=layers,
            dtype=torch.int64,
            packed=True,
            layer_major=True,
            timeout_s=timeout_s,
        )
        index = np.zeros(len(row), np.int64)
        index[real] = cu.numpy()[seq[real]] + row[real] - lo[seq[real]]
        local = src.index_select(1, torch.from_numpy(index))
    else:
        local = torch.empty((len(layers), len(row), top_k), dtype=torch.int64)
    if not real.all():
        pad = torch.from_numpy(~real)
        local[:, pad] = torch.arange(top_k, dtype=torch.int64)
    if device is not None:
        local = local.to(device)
    return list(local.unbind(0))
