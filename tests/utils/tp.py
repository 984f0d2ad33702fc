# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What each tensor-parallel rank does for R3, read inside the worker with
``collective_rpc(rank_facts)``. Shared by the CPU engine tests and the GPU
tests (tests/gpu/r3_engine.py); imports nothing heavy at module level."""

from __future__ import annotations

import os


def rank_facts(worker) -> dict:
    """This rank's part in R3: its global and tensor-parallel rank, whether
    it publishes, the files under the store root it holds open or mapped,
    and its capture buffer's first row (the last forward's first token,
    ``[layers, top_k]``)."""
    import torch

    from vllm.distributed.parallel_state import get_tp_group

    connector = worker.model_runner.artifact_connector
    capturer = connector._capture.capturer
    root = os.path.realpath(worker.vllm_config.artifact_config.shm_root)
    return {
        "global_rank": torch.distributed.get_rank(),
        "tp_rank": get_tp_group().rank_in_group,
        "pid": os.getpid(),
        "publishes": connector.stats() != {},
        "store_files_in_use": _files_in_use_under(root),
        "capture_row0": capturer.device_buffer[0].cpu().tolist(),
    }


def _files_in_use_under(root: str) -> list[str]:
    """Paths under ``root`` this process holds open or mapped."""
    paths = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            paths.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile
            continue
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6:
                paths.add(parts[5].strip())
    prefix = root.rstrip("/") + "/"
    return sorted(p for p in paths if p == root or p.startswith(prefix))
