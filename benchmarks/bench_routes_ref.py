# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routes inline (base64 ``.npy`` in the JSON) against routes by reference
(the host transport), in one run. Prints JSON.

Shape: 48 layers, top-8, uint8 (Qwen3-30B-A3B's routes), responses of 1k,
8k and 32k tokens (32k: 12.6 MB), and a batch of 256 x 8k finishing
together. Each side runs the code the server runs:

* inline: the engine core sends the array to the API server in its output
  (vLLM's ``MsgpackEncoder``/``MsgpackDecoder``, the array out of band, as
  ``EngineCoreOutputs`` travel); the API server encodes it
  (``numpy2base64``, what ``choices[i].routed_experts`` holds) and serialises
  the choice to JSON; the client parses the JSON and decodes the field
  (``decode_routed_experts``, with its checks);
* ref: the engine core's route reader hands the array to ``RouteRefs``
  (``publish``: a copy into the host transport, its checksum); the API
  server serialises the reference to JSON; a separate consumer process, which
  never imports vLLM or torch, parses it and calls ``fetch`` (claim, copy out
  of the segment, checksum; a borrowed mapping until issue 37); its later
  release of the arrays is timed apart;
* mooncake: the same through a Mooncake Store (``ref_transport:
  mooncake``) behind a real ``mooncake_master`` on 127.0.0.1 (TCP), started
  by this script when Mooncake is installed.

"client" is the time from the end of the request's compute to the numpy
array in the client's hands, the sum of the stages above (the HTTP transfer
of the JSON body itself is not timed; its size is reported as
``api_bytes``); "api_server" is the API server's share; ``memcpy`` is one
copy of the array into a warm buffer, the goal's yardstick (ref client time
at most 3x of it for 32k). Medians over ``--reps`` repetitions.

Run: ``.venv/bin/python benchmarks/bench_routes_ref.py``
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent / "tools" / "cpu_harness")
)
from harness_env import apply_harness_env

apply_harness_env(enable_triton_interpreter=False)

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
import uuid

import numpy as np
from mooncake_master import start_master

from vllm.config.artifact import ArtifactConfig
from vllm.distributed.artifact_connector.route_refs import RouteRefs
from vllm.utils.routed_experts_codec import decode_routed_experts
from vllm.utils.serial_utils import numpy2base64
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

LAYERS, TOP_K = 48, 8

# The consumer: reads one reference per line, answers with its fetch time.
CONSUMER = r"""
import json, sys, time
from vllm_host_transport.routed_experts import fetch
for line in sys.stdin:
    refs = json.loads(line)
    t0 = time.perf_counter()
    arrays = [fetch(r) for r in refs]
    dt = time.perf_counter() - t0
    rows = sum(a.shape[0] for a in arrays)
    t0 = time.perf_counter()
    del arrays  # borrowed mappings: their pages are freed here
    release = time.perf_counter() - t0
    loaded = [m for m in sys.modules if m.split(".")[0] in ("vllm", "torch")]
    print(json.dumps({"s": dt, "release_s": release, "rows": rows,
                      "loaded": loaded}), flush=True)
"""


def routes(tokens: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 128, (tokens - 1, LAYERS, TOP_K), dtype=np.uint8)


def memcpy_s(a: np.ndarray, reps: int) -> float:
    dst = np.empty_like(a)
    np.copyto(dst, a)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, a)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def inline_once(arrays: list[np.ndarray]) -> dict[str, float]:
    """Engine to API server, API server, client, for one batch of choices."""
    enc, dec = MsgpackEncoder(), MsgpackDecoder(list[np.ndarray])
    t0 = time.perf_counter()
    frames = enc.encode(arrays)
    received = dec.decode(frames)
    t1 = time.perf_counter()
    body = json.dumps(
        {"choices": [{"index": i, "routed_experts": numpy2base64(a)}
                     for i, a in enumerate(received)]}
    )  # fmt: skip
    t2 = time.perf_counter()
    got = [
        decode_routed_experts(c["routed_experts"]) for c in json.loads(body)["choices"]
    ]
    t3 = time.perf_counter()
    assert all(np.array_equal(g, a) for g, a in zip(got, arrays))
    return {
        "engine_to_api_s": t1 - t0,
        "api_server_s": t2 - t1,
        "client_decode_s": t3 - t2,
        "client_s": t3 - t0,
        "api_bytes": len(body),
    }


def ref_once(refs_out: RouteRefs, consumer, arrays: list[np.ndarray]) -> dict:
    t0 = time.perf_counter()
    refs = [refs_out.publish(a, 0) for a in arrays]
    t1 = time.perf_counter()
    body = json.dumps(
        {"choices": [{"index": i, "routed_experts_ref": r.to_json()}
                     for i, r in enumerate(refs)]}
    )  # fmt: skip
    t2 = time.perf_counter()
    consumer.stdin.write(
        json.dumps([c["routed_experts_ref"] for c in json.loads(body)["choices"]])
        + "\n"
    )
    consumer.stdin.flush()
    answer = json.loads(consumer.stdout.readline())
    assert answer["loaded"] == [], answer["loaded"]
    assert answer["rows"] == sum(a.shape[0] for a in arrays)
    return {
        "engine_publish_s": t1 - t0,
        "api_server_s": t2 - t1,
        "client_fetch_s": answer["s"],
        "client_release_s": answer["release_s"],
        "client_s": (t1 - t0) + (t2 - t1) + answer["s"],
        "api_bytes": len(body),
    }


def start_mooncake() -> tuple[subprocess.Popen | None, RouteRefs | None]:
    """A ``mooncake_master`` and the engine side's Mooncake sink, or
    ``(None, None)`` when Mooncake is not installed."""
    started = start_master()
    if started is None:
        return None, None
    master, address = started
    cfg = ArtifactConfig(
        ref_transport="mooncake",
        mooncake_master=address,
        mooncake_segment_bytes=2 << 30,
        mooncake_buffer_bytes=64 << 20,
        ref_max_bytes=4 << 30,
    )
    return master, RouteRefs(cfg)


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=256, help="requests of the 8k batch")
    args = ap.parse_args()
    scope = f"bench-ref-{uuid.uuid4().hex[:8]}"
    # PYTHONPATH stays (a node where the fork's packages are on it, as the GPU
    # harness's): the consumer's answer says it imported neither vLLM nor torch.
    env = dict(os.environ)
    env["MC_FORCE_TCP"] = "true"
    consumer = subprocess.Popen(
        [sys.executable, "-c", CONSUMER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # Mooncake's own logging
        text=True,
        env=env,
    )
    refs_out = RouteRefs(ArtifactConfig(ref_scope=scope, ref_max_bytes=4 << 30))
    master, mooncake_out = start_mooncake()
    result: dict = {
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "load_start": os.getloadavg(),
        "shape": f"[tokens - 1, {LAYERS}, {TOP_K}] uint8",
    }
    try:
        cases = [("1k", 1024, 1), ("8k", 8192, 1), ("32k", 32768, 1)]
        cases.append((f"{args.batch}x8k", 8192, args.batch))
        for name, tokens, n in cases:
            arrays = [routes(tokens, i) for i in range(n)]
            reps = args.reps if n == 1 else max(1, args.reps // 2)
            inline = median_of([inline_once(arrays) for _ in range(reps)])
            ref = median_of([ref_once(refs_out, consumer, arrays) for _ in range(reps)])
            mc = (
                median_of(
                    [ref_once(mooncake_out, consumer, arrays) for _ in range(reps)]
                )
                if mooncake_out is not None
                else None
            )
            copy = sum(memcpy_s(a, 20) for a in arrays[:8]) * n / min(n, 8)
            result[name] = {
                "requests": n,
                "array_bytes": arrays[0].nbytes,
                "memcpy_s": copy,
                "inline": inline,
                "ref": ref,
                "client_inline_over_ref": inline["client_s"] / ref["client_s"],
                "ref_client_over_memcpy": ref["client_s"] / copy,
                "ref_fetch_over_memcpy": ref["client_fetch_s"] / copy,
                "api_bytes_inline_over_ref": inline["api_bytes"] / ref["api_bytes"],
                "mooncake": mc,
                "mooncake_fetch_over_memcpy": (
                    mc["client_fetch_s"] / copy if mc is not None else None
                ),
            }
    finally:
        assert consumer.stdin is not None
        consumer.stdin.close()
        consumer.wait(timeout=60)
        refs_out.close()
        if mooncake_out is not None:
            mooncake_out.close()
        if master is not None:
            master.terminate()
            master.wait(timeout=30)
    result["load_end"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
