# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The processes of the many-engines-per-node test (tests/test_r3_small_shm.py),
run in a mount namespace whose small ``/dev/shm`` they share.

``python shm_engine.py engine MODEL OUT INDEX ENGINES PLAN``: one engine.
Starts an R3 engine with its store in ``/dev/shm``, sized from it
(``engines_per_node`` ENGINES), and runs the rounds of PLAN (JSON:
``warm`` prompts, then ``rounds`` rounds of ``per_round`` prompts of about
``prompt_len`` random token ids each). After the warm prompts it waits
until its store holds two arenas (the active one and the spare its upkeep
prepares), says so (``OUT/ready-<INDEX>``) and waits for ``OUT/go``: the
other tenant fills ``/dev/shm`` in between. Writes ``OUT/engine-<INDEX>.npz``
(each prompt's ids, completion ids and routes, or its error) and
``OUT/engine-<INDEX>.json`` (the store's counters, its arenas at the
barrier, ``/dev/shm``'s free space after each round), then stops the engine.

``python shm_engine.py fill OUT ENGINES ROOM``: the other tenant. Waits for
every engine's ``ready-<i>``, then allocates one file so that ROOM bytes of
``/dev/shm`` stay free (less than one arena), records what it saw in
``OUT/fill.json`` and writes ``OUT/go``.

The waits have a generous deadline only so that a broken run ends; nothing
is measured against the clock."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WAIT_S = 600.0


def _shm() -> dict:
    st = os.statvfs("/dev/shm")
    files = {}
    for dirpath, _, names in os.walk("/dev/shm"):
        for n in names:
            with contextlib.suppress(OSError):
                p = os.path.join(dirpath, n)
                files[p[len("/dev/shm/") :]] = os.stat(p).st_blocks * 512
    held = set()
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/" in line and "(deleted)" in line:
                held.add(line.split(None, 5)[-1].strip())
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            t = os.readlink(f"/proc/self/fd/{fd}")
            if t.startswith("/dev/shm/") and t.endswith("(deleted)"):
                held.add(t)
    return {
        "size": st.f_blocks * st.f_frsize,
        "free": st.f_bavail * st.f_frsize,
        "files": files,
        "deleted_held": sorted(held),
    }


def _wait_for(what: str, ready) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.1)


def _touch(path: str) -> None:
    with open(path + ".tmp", "w"):
        pass
    os.rename(path + ".tmp", path)


def fill(out: str, engines: int, room: int) -> None:
    """Leave ``room`` bytes of /dev/shm free (``posix_fallocate`` takes the
    pages at once; tmpfs has no reserve, so statvfs's free is exact)."""
    _wait_for(
        "the engines' warm-up",
        lambda: all(os.path.exists(f"{out}/ready-{j}") for j in range(engines)),
    )
    before = _shm()
    take = max(0, before["free"] - room)
    fd = os.open("/dev/shm/other-tenant", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if take:
            os.posix_fallocate(fd, 0, take)
    finally:
        os.close(fd)
    after = _shm()
    with open(f"{out}/fill.json", "w") as f:
        json.dump({"before": before, "taken": take, "after": after}, f)
    _touch(f"{out}/go")


def _arenas(root: str) -> int:
    return len(glob.glob(os.path.join(root, "*", "*.arena")))


def engine(model: str, out: str, index: int, engines: int, plan: dict) -> None:
    from utils.r3 import engine_kwargs, greedy, worker_stats

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # worker_stats
    # The engine core and its worker in this process (the uni executor): the
    # mp executor's message queue wants 160 MiB of /dev/shm, and the tiny
    # tmpfs is for the stores.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, TokensPrompt

    root = f"/dev/shm/vart-test-{os.getpid()}-engine{index}"
    prompt_len = int(plan["prompt_len"])
    llm = LLM(
        **engine_kwargs(
            model,
            max_num_seqs=int(plan["max_num_seqs"]),
            max_model_len=prompt_len + 64,
            artifact_config={
                "shm_root": root,  # capacity_bytes from this /dev/shm
                "engines_per_node": engines,
            },
        )
    )
    vocab = llm.get_tokenizer().vocab_size
    rng = np.random.default_rng(1000 + index)
    results: dict[str, object] = {}
    report: dict[str, object] = {"shm_after_rounds": []}

    def run(name: str, count: int) -> None:
        prompts = [
            rng.integers(10, vocab - 10, prompt_len - int(rng.integers(0, 32))).tolist()
            for _ in range(count)
        ]
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], greedy(4)
        )
        for k, (p, o) in enumerate(zip(prompts, outs)):
            c = o.outputs[0]
            key = f"{name}p{k}"
            results[f"{key}_prompt"] = np.asarray(p, np.int64)
            results[f"{key}_tokens"] = np.asarray(c.token_ids, np.int64)
            if c.routed_experts is not None:
                results[f"{key}_routes"] = c.routed_experts
            else:
                results[f"{key}_error"] = np.asarray(str(c.routed_experts_error))
        report["shm_after_rounds"].append(_shm())  # type: ignore[union-attr]

    run("warm", int(plan["warm"]))
    # The spare arena is prepared by the store's upkeep after the last put.
    _wait_for("the spare arena", lambda: _arenas(root) >= 2)
    report["arenas_at_barrier"] = _arenas(root)
    report["stats_at_barrier"] = worker_stats(llm)
    _touch(f"{out}/ready-{index}")
    _wait_for("the other tenant", lambda: os.path.exists(f"{out}/go"))
    for r in range(int(plan["rounds"])):
        run(f"r{r}", int(plan["per_round"]))
    report["stats"] = worker_stats(llm)
    np.savez(os.path.join(out, f"engine-{index}.npz"), **results)
    with open(os.path.join(out, f"engine-{index}.json"), "w") as f:
        json.dump(report, f, default=str)
    llm.shutdown() if hasattr(llm, "shutdown") else None


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "fill":
        out, engines, room = args
        fill(out, int(engines), int(room))
    elif mode == "engine":
        model, out, index, engines, plan = args
        engine(model, out, int(index), int(engines), json.loads(plan))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
