# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One engine of the many-engines-per-node test (tests/test_r3_small_shm.py),
run as its own process in a mount namespace whose small ``/dev/shm`` it
shares with the other engines.

``python shm_engine.py MODEL OUT INDEX ENGINES ROUNDS PER_ROUND CAPACITY``:
starts an R3 engine with its store in ``/dev/shm`` (``capacity_bytes``
CAPACITY), then runs ROUNDS rounds of PER_ROUND fresh prompts (random
token ids, about 600 tokens each). After the first round it waits until
every engine has finished its first round (files ``ready-<i>`` in OUT), so
that all stores are in the one ``/dev/shm`` together before the rest
fills it. Writes ``OUT/engine-<INDEX>.npz`` (each prompt's ids, completion
ids and routes, or its error) and ``OUT/engine-<INDEX>.json`` (the store's
counters and what ``/dev/shm`` looked like), then stops the engine."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from utils.r3 import engine_kwargs, greedy, worker_stats  # noqa: E402


def _shm() -> dict:
    st = os.statvfs("/dev/shm")
    return {
        "size": st.f_blocks * st.f_frsize,
        "free": st.f_bavail * st.f_frsize,
    }


def main() -> None:
    model, out, index, engines, rounds, per_round, capacity = sys.argv[1:]
    i, n = int(index), int(engines)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # worker_stats
    # The engine core and its worker in this process (the uni executor): the
    # mp executor's message queue wants 160 MiB of /dev/shm, and the tiny
    # tmpfs is for the stores.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, TokensPrompt

    root = f"/dev/shm/vart-test-{os.getpid()}-engine{i}"
    llm = LLM(
        **engine_kwargs(
            model,
            max_num_seqs=4,
            artifact_config={
                "shm_root": root,
                # 0: sized from the node (this /dev/shm, ENGINES engines)
                **({"capacity_bytes": int(capacity)} if int(capacity) else {}),
                "engines_per_node": n,
                "routed_experts_dtype": "int32",  # larger objects, fewer prompts
            },
        )
    )
    vocab = llm.get_tokenizer().vocab_size
    rng = np.random.default_rng(1000 + i)
    results: dict[str, object] = {}
    shm_after = []
    for r in range(int(rounds)):
        prompts = [
            rng.integers(10, vocab - 10, 560 + int(rng.integers(0, 64))).tolist()
            for _ in range(int(per_round))
        ]
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], greedy(4)
        )
        for k, (p, o) in enumerate(zip(prompts, outs)):
            c = o.outputs[0]
            name = f"r{r}p{k}"
            results[f"{name}_prompt"] = np.asarray(p, np.int64)
            results[f"{name}_tokens"] = np.asarray(c.token_ids, np.int64)
            if c.routed_experts is not None:
                results[f"{name}_routes"] = c.routed_experts
            else:
                results[f"{name}_error"] = np.asarray(str(c.routed_experts_error))
        shm_after.append(_shm())
        if r == 0:
            open(os.path.join(out, f"ready-{i}"), "w").close()
            deadline = time.monotonic() + 600
            while not all(
                os.path.exists(os.path.join(out, f"ready-{j}")) for j in range(n)
            ):
                if time.monotonic() > deadline:
                    raise SystemExit("the other engines never finished round 0")
                time.sleep(0.2)
    stats = worker_stats(llm)
    np.savez(os.path.join(out, f"engine-{i}.npz"), **results)
    with open(os.path.join(out, f"engine-{i}.json"), "w") as f:
        json.dump({"stats": stats, "shm_after_rounds": shm_after}, f, default=str)
    llm.shutdown() if hasattr(llm, "shutdown") else None
    del llm


if __name__ == "__main__":
    main()
