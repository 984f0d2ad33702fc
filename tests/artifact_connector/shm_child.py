# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helper process for the multi-process SHM store tests.

``python shm_child.py writer ROOT NS NBATCHES BATCH SIZE FAULT_BATCH STAGE
HOLD [STATUS_FILE]`` publishes ``NBATCHES`` batches of ``BATCH`` objects;
``python shm_child.py reader ROOT NS TOTAL SIZE WAIT_ALL`` reads them back
and prints JSON.

Faults are injected here, in the test process, never through hooks in the
store: ``after_data`` kills the writer inside ``fill`` (data written, not
indexed); ``mid_index`` replaces the writer module's ``write_all`` so that
the batch's index record is half written when the process is killed.

To keep start-up fast the store is loaded without running ``vllm/__init__``
(which imports torch, ~5 s): the parent packages are registered as bare
package stubs pointing at the real directories and ``vllm.logger`` as
``logging``. The modules under test are the same files the parent imports;
if the store ever needs more of vLLM, this child fails at import.
"""

import importlib.util
import json
import logging
import mmap
import os
import signal
import sys
import types

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from helpers import key, payload  # noqa: E402


def _load():
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.submodule_search_locations is None:
        raise RuntimeError("vllm is not importable")
    base = list(spec.submodule_search_locations)[0]
    for name, rel in (
        ("vllm", ""),
        ("vllm.config", "config"),
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
    from vllm.distributed.artifact_connector.shm import files as files_mod

    return shm, store, files_mod


def _kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def writer(root, ns, nbatches, batch, size, fault_batch, stage, hold, status):
    shm, _, files_mod = _load()
    w = shm.ShmStoreWriter(root, ns)
    # status[0]: batches published; status[1]: 1 while inside put_batch.
    st = None
    if status:
        fd = os.open(status, os.O_RDWR)
        st = np.frombuffer(mmap.mmap(fd, 4096), np.int64)
        os.close(fd)
    for b in range(nbatches):
        items = [(key(i), payload(i, size)) for i in range(b * batch, (b + 1) * batch)]
        if b == fault_batch and stage == "mid_index":
            real = files_mod.write_all

            def half_then_die(fd, bufs, offset, _real=real):
                data = b"".join(bytes(x) for x in bufs)
                _real(fd, [data[: len(data) // 2]], offset)
                _kill_self()

            files_mod.write_all = half_then_die
        values = [v for _, v in items]

        def fill(buf, _values=values, _b=b):
            if st is not None:
                st[1] = 1
            o = 0
            for v in _values:
                buf[o : o + len(v)] = np.frombuffer(v, np.uint8)
                o += len(v)
            if _b == fault_batch and stage == "after_data":
                _kill_self()

        lengths = np.array([len(v) for v in values], np.int64)
        w.put_batch([k for k, _ in items], lengths, fill)
        if st is not None:
            st[0] = b + 1
            st[1] = 0
        print(f"published {b}", flush=True)
    print("done", flush=True)
    if hold:
        sys.stdin.read()  # the parent closes stdin (or kills us)
    os._exit(0)  # without closing: the store stays for the test to collect


def reader(root, ns, total, size, wait_all):
    shm, store, _ = _load()
    r = shm.ShmStoreReader(root, ns)
    seen: set[int] = set()
    mismatches = 0
    while True:
        for i in range(total):
            if i in seen:
                continue
            v = payload(i, size)
            sums = np.array([store.checksum(v)], np.uint64)
            out = np.zeros(size, np.uint8)
            try:
                r.read_into([key(i)], sums, out, np.array([[0, size, 0]]))
            except store.ObjectMissingError:
                continue
            if out.tobytes() != v:
                mismatches += 1
            seen.add(i)
        if not wait_all or len(seen) == total:
            break
    print(json.dumps({"seen": sorted(seen), "mismatches": mismatches}), flush=True)
    r.close()


def main():
    role, root, ns, *args = sys.argv[1:]
    if role == "writer":
        nb, bs, size, fb = (int(a) for a in args[:4])
        status = args[6] if len(args) > 6 else ""
        writer(root, ns, nb, bs, size, fb, args[4], args[5] == "1", status)
    elif role == "reader":
        total, size, wait_all = (int(a) for a in args[:3])
        reader(root, ns, total, size, wait_all == 1)
    else:
        raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    main()
