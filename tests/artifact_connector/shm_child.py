# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helper process for the multi-process SHM store tests.

Run as ``python shm_child.py ROLE ROOT NAMESPACE [ARGS]``. To keep start-up
fast it loads the artifact modules without executing ``vllm/__init__``
(which imports torch): the parent packages are registered as bare package
stubs that point at the real directories.

Why the stubs are kept: ``import vllm.logger`` alone runs ``vllm/__init__``
and takes about 5 s here, while ``store`` and ``shm`` need nothing from
vLLM but ``vllm.logger.init_logger`` (numpy and xxhash otherwise). The
stubs touch only those three package names plus ``vllm.logger`` (replaced
by ``logging.getLogger``), exist only in this throw-away child process, and
the parent test process imports the real modules, so the code under test is
the same files. If ``shm`` or ``store`` ever import more of vLLM, the child
fails at import with a clear ImportError rather than testing something else.
"""

import hashlib
import json
import logging
import os
import signal
import sys
import types


def _load():
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.submodule_search_locations is None:
        raise RuntimeError("vllm is not importable")
    base = list(spec.submodule_search_locations)[0]
    for name, rel in (
        ("vllm", ""),
        ("vllm.distributed", "distributed"),
        ("vllm.distributed.artifact_connector", "distributed/artifact_connector"),
    ):
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(base, rel)]  # type: ignore[attr-defined]
        sys.modules[name] = mod
    logger_mod = types.ModuleType("vllm.logger")
    logger_mod.init_logger = logging.getLogger  # type: ignore[attr-defined]
    sys.modules["vllm.logger"] = logger_mod
    from vllm.distributed.artifact_connector import shm, store

    return shm, store


def key_of(i: int) -> str:
    return hashlib.sha256(b"obj-%d" % i).hexdigest()


def payload_of(i: int, size: int) -> bytes:
    seed = hashlib.sha256(b"payload-%d" % i).digest()
    return (seed * (size // len(seed) + 1))[:size]


def writer(root, ns, nbatches, batch, size, fault_batch, fault_stage, hold):
    shm, _ = _load()
    w = shm.ShmObjectStore.create(
        root, ns, collect_on_start=False, remove_on_close=False
    )
    for b in range(nbatches):
        if b == fault_batch:

            def hook(stage, _s=fault_stage):
                if stage == _s:
                    os.kill(os.getpid(), signal.SIGKILL)

            w._fault_hook = hook
        w.put_many(
            [
                (key_of(i), payload_of(i, size))
                for i in range(b * batch, (b + 1) * batch)
            ]
        )
        print(f"published {b}", flush=True)
    print("done", flush=True)
    if hold:
        sys.stdin.read()  # parent closes stdin (or kills us)


def reader(root, ns, total, size, wait_all):
    shm, store = _load()
    r = shm.ShmObjectStore.open_reader(root, ns)
    seen: set[int] = set()
    mismatches = 0
    missing_after = []
    checks = 0
    while True:
        for i in range(total):
            if i in seen:
                continue
            k = key_of(i)
            if not r.exists(k):
                continue
            data = r.get(k)
            checks += 1
            if data != payload_of(i, size):
                mismatches += 1
            seen.add(i)
        if not wait_all or len(seen) == total:
            break
    if not wait_all:
        missing_after = [i for i in range(total) if i not in seen]
    print(
        json.dumps(
            {
                "seen": sorted(seen),
                "missing": missing_after,
                "mismatches": mismatches,
                "checks": checks,
            }
        ),
        flush=True,
    )
    r.close()


def main():
    role, root, ns, *args = sys.argv[1:]
    if role == "writer":
        nb, bs, size, fb = (int(a) for a in args[:4])
        writer(root, ns, nb, bs, size, fb, args[4], args[5] == "1")
    elif role == "reader":
        writer_args = [int(a) for a in args[:3]]
        reader(root, ns, writer_args[0], writer_args[1], writer_args[2] == 1)
    else:
        raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    main()
