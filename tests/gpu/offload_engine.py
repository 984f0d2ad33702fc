# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One engine of ``test_r3_gpu_offload.py`` (its own process: a KV connector
is process-wide state): the fork with R3 and a 40-block device KV cache, with
(``offload``) or without (``plain``) CPU KV offload (``OffloadingConnector``,
kv_both). A 200-token prompt, four others that push its blocks out of the
device cache, then the prompt again. ``simple`` runs the same with the
other CPU offload connector the config accepts (``SimpleCPUOffloadConnector``,
kv_both). Writes ``<out>/offload_<name>.json``:
cached tokens, tokens, routes (and the error, if any) of both runs."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

MODEL = os.environ.get("R3_GPU_MODEL", ".devcarry/models/tiny-moe")


def main(name: str, out_dir: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict = dict(
        model=MODEL,
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=True,
        attention_backend="TRITON_ATTN",
        moe_backend="triton",
        dtype="float32",
        max_model_len=512,
        max_num_seqs=4,
        seed=0,
        gpu_memory_utilization=0.15,
        num_gpu_blocks_override=40,
        # 40 blocks of 16 tokens (0.34's default for this model is 64, and 40
        # of those hold every prompt of the test).
        block_size=16,
        enable_routed_experts=True,
        artifact_config={"shm_root": f"/dev/shm/r3-gpu-offload-{os.getpid()}"},
    )
    from vllm.engine.arg_utils import EngineArgs

    if hasattr(EngineArgs, "enable_extensible_kv_cache"):
        # vLLM 0.34 sizes an extensible KV cache (its CUDA default) after
        # warm-up, past num_gpu_blocks_override: the fillers would then not
        # push the prompt's blocks out.
        kw["enable_extensible_kv_cache"] = False
    connector = {
        "offload": "OffloadingConnector",
        "simple": "SimpleCPUOffloadConnector",
    }
    if name in connector:
        kw["kv_transfer_config"] = {
            "kv_connector": connector[name],
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 256 << 20},
        }
    llm = LLM(**kw)
    rng = np.random.default_rng(0)
    prompt, *fillers = (rng.integers(3, 500, 200).tolist() for _ in range(5))
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def one(ids):
        (o,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
        c = o.outputs[0]
        routes = c.routed_experts
        return {
            "cached": o.num_cached_tokens,
            "tokens": list(c.token_ids),
            "error": c.routed_experts_error,
            "routes": None if routes is None else routes.astype(int).tolist(),
        }

    res = {"first": one(prompt)}
    for f in fillers:
        one(f)
    res["again"] = one(prompt)
    llm.llm_engine.engine_core.shutdown(timeout=30)
    with open(os.path.join(out_dir, f"offload_{name}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
