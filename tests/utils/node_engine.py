# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An offline ``LLM`` in a process of its own (run inside a simulated node,
tests/utils/nodes.py), driven by JSON lines.

``python tests/utils/node_engine.py '<kwargs JSON>'`` builds
``LLM(**engine_kwargs(model, **kwargs))`` (its ``artifact_config`` merged
into the test default's), answers ``{"ready": true}`` and then one JSON line
per request line:

- ``{"op": "generate", "prompts": [...], "max_tokens": n, "format": f}``:
  ``{"outputs": [...]}``, each with ``prompt_token_ids``, ``token_ids``,
  ``num_cached_tokens``, ``finish_reason``, ``routes`` (base64 ``.npy`` or
  null), ``error`` (``routed_experts_error``) and ``ref`` (the reference's
  JSON or null);
- ``{"op": "metrics"}``: ``{"metrics": {name: value}}``, the routed-experts
  counters and gauges;
- ``{"op": "reset_prefix_cache"}``: ``{"ok": bool}``;
- ``{"op": "exit"}`` (or the end of stdin): the engine is shut down.

A failure answers ``{"error": traceback}``. vLLM's own output goes to
stderr; the answers use the process's original stdout only.
"""

from __future__ import annotations

import base64
import io
import json
import os
import sys
import traceback
from pathlib import Path

# Run as a script, its own folder comes first on the path, where
# tests/utils/mooncake.py would hide Mooncake's package: tests/ instead.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

P = "vllm:routed_experts_"


def _npy(array) -> str:
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def _outputs(outs) -> list[dict]:
    answers = []
    for out in outs:
        (c,) = out.outputs
        ref = c.routed_experts_ref
        answers.append(
            dict(
                prompt_token_ids=list(out.prompt_token_ids),
                token_ids=list(c.token_ids),
                num_cached_tokens=out.num_cached_tokens,
                finish_reason=c.finish_reason,
                routes=None if c.routed_experts is None else _npy(c.routed_experts),
                error=c.routed_experts_error,
                ref=None if ref is None else ref.to_json(),
            )
        )
    return answers


def _metrics(llm) -> dict[str, float]:
    found: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith(P) and hasattr(m, "value"):
            found[m.name[len(P) :]] = found.get(m.name[len(P) :], 0) + m.value
    return found


def main() -> None:
    # The answers keep the original stdout; everything else (vLLM's logs)
    # goes to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(obj) -> None:
        answers.write(json.dumps(obj) + "\n")

    from utils.r3 import engine_kwargs, greedy
    from vllm import LLM

    spec = json.loads(sys.argv[1])
    artifact = spec.pop("artifact_config", {})
    kwargs = engine_kwargs(spec.pop("model"), **spec)
    kwargs["artifact_config"].update(artifact)
    llm = LLM(**kwargs)
    answer({"ready": True, "pid": os.getpid()})
    try:
        for line in sys.stdin:
            job = json.loads(line)
            try:
                if job["op"] == "exit":
                    break
                if job["op"] == "generate":
                    params = greedy(
                        job["max_tokens"],
                        routed_experts_format=job.get("format", "inline"),
                    )
                    outs = llm.generate(job["prompts"], params, use_tqdm=False)
                    answer({"outputs": _outputs(outs)})
                elif job["op"] == "metrics":
                    answer({"metrics": _metrics(llm)})
                elif job["op"] == "reset_prefix_cache":
                    answer({"ok": bool(llm.reset_prefix_cache())})
                else:
                    answer({"error": f"unknown op {job['op']!r}"})
            except Exception:
                answer({"error": traceback.format_exc()})
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=30)


if __name__ == "__main__":
    main()
