#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Eight trainer processes each read their slice of the routes by reference.

The driver runs a tiny Qwen3-MoE (4 decoder layers, layer 0 dense) with
``routed_experts_format="ref"``, and hands the references (small dicts) to 8
trainer processes: 4 pipeline stages x 2 data-parallel halves. Each rank
reads only the MoE layers of its stage for the sequences of its half, builds
megatron-core's ``RouterReplay`` input from them, checks it against the
whole array, and marks itself done; the last of the 8 removes each payload.

    .venv/bin/python docs/examples/trainer_slices.py [--requests 8]

(on this CPU harness, under the engine lock when tests run beside it:
``flock .cache/engine.lock .venv/bin/python docs/examples/trainer_slices.py``)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tools" / "cpu_harness"))

STAGES, HALVES = 4, 2
READERS = STAGES * HALVES


def trainer(rank: int, model_dir: str, refs: list[dict], results: mp.Queue) -> None:
    """Rank ``rank``: pipeline stage ``rank // 2``, data-parallel half
    ``rank % 2``. Needs numpy, torch and vllm_host_transport; no vLLM."""
    import torch

    from vllm_host_transport.megatron_replay import replay_inputs
    from vllm_host_transport.routes_layers import moe_layers_of_stage
    from vllm_host_transport.routes_reader import read, release

    stage, half = divmod(rank, HALVES)
    mine = refs[half::HALVES]  # this half's micro-batch
    layers = moe_layers_of_stage(model_dir, stage, STAGES)  # absolute indices
    # One int64 [tokens, top_k] tensor per router of this stage, in order.
    tensors = replay_inputs(mine, layers) if layers else []
    # Check: token t of each sequence replays row t (the last token its
    # predecessor's row), for every layer of the stage.
    at = 0
    for ref in mine:
        whole = torch.from_numpy(read(ref, layers=layers, dtype="int64"))
        rows = ref["shape"][0]
        for i in range(len(layers)):
            got = tensors[i][at : at + rows + 1]
            assert torch.equal(got[:rows], whole[:, i]) and torch.equal(
                got[rows], got[rows - 1]
            )
        at += rows + 1
    try:  # hand them to megatron-core when it is installed
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()
        for _ in layers:
            RouterReplay()  # what each MoE layer of the stage creates
        RouterReplay.set_replay_data(tensors)
    except ImportError:
        pass
    # Every rank marks itself done; the 8th to do so removes each payload.
    removed = release(refs, reader=rank, readers=READERS)
    results.put((rank, stage, half, layers, [tuple(t.shape) for t in tensors], removed))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()

    from build_tiny_moe import TinyMoEParams, build
    from harness_env import CACHE, apply_harness_env

    apply_harness_env()
    model_dir = build(
        CACHE / "models" / "tiny-moe-4l", TinyMoEParams(layers=4, dense_layers=[0])
    )
    from vllm import LLM, SamplingParams
    from vllm_host_transport.routes_reader import read

    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        enable_routed_experts=True,
        max_model_len=512,
        seed=0,
    )
    try:
        params = SamplingParams(
            max_tokens=12, temperature=1.0, seed=0, routed_experts_format="ref"
        )
        prompts = [f"Request {i}: experts route tokens." for i in range(args.requests)]
        refs = []
        for out in llm.generate(prompts, params, use_tqdm=False):
            ref = out.outputs[0].routed_experts_ref
            if ref is None:  # no exact routes for this one: leave it out
                print("dropped:", out.outputs[0].routed_experts_error)
                continue
            refs.append(ref.to_json())
        print(f"driver: {len(refs)} references, e.g. {refs[0]}")
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [
            ctx.Process(target=trainer, args=(r, str(model_dir), refs, results))
            for r in range(READERS)
        ]
        for p in procs:
            p.start()
        got = sorted(results.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(60)
        for rank, stage, half, layers, shapes, removed in got:
            print(
                f"rank {rank}: stage {stage} half {half} layers {layers} "
                f"replay tensors {shapes} removed {removed}"
            )
        assert all(p.exitcode == 0 for p in procs)
        assert sum(g[-1] for g in got) == len(refs)  # each payload removed once
        try:
            read(refs[0])
        except Exception as e:  # RouteRefMissingError: released
            print(f"after the last reader: {type(e).__name__}")
        else:
            raise AssertionError("a released reference was still readable")
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
