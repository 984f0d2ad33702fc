# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A trainer's side of routes by reference, in its own process on the GPU
node: it imports neither vLLM nor torch.

    python3 tests/gpu/fetch_refs.py OUT_NPZ < refs.json

Reads a JSON object ``{name: reference}`` from stdin, fetches each
reference (``vllm_host_transport.routed_experts.fetch``), writes the arrays
to ``OUT_NPZ`` and prints ``FETCHED <json>``: each fetch's seconds, and the
heavy modules the process imported (none)."""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from vllm_host_transport.routed_experts import fetch


def main() -> None:
    refs = json.load(sys.stdin)
    arrays, seconds = {}, {}
    for name, ref in refs.items():
        t = time.perf_counter()
        arrays[name] = fetch(ref)
        seconds[name] = time.perf_counter() - t
    np.savez(sys.argv[1], **arrays)
    heavy = sorted(m for m in ("vllm", "torch") if m in sys.modules)
    print("FETCHED " + json.dumps({"seconds": seconds, "imported": heavy}))


if __name__ == "__main__":
    main()
