# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which Mooncake client calls hold Python's interpreter lock while they
run, and for how long. Prints JSON.

The engine core runs its step loop and the Artifact Connector's threads in
one interpreter: a Mooncake call that holds the lock stalls the step loop
for as long as it runs. A thread here ticks every millisecond and records
its longest gap while the main thread (or, for a frozen master, a helper
thread) makes one call; the gap is the time the call held the lock (the
baseline, ``idle``, is the ticker alone). Against a healthy
``mooncake_master`` on 127.0.0.1 (TCP): ``setup`` with and without a
segment, an existence query, ``close``. Against the same master frozen
(``SIGSTOP``), each call the connector makes while serving (existence
query, remove, zero-copy get and put) runs for ``--frozen-s`` seconds on a
helper thread; ``setup`` against the frozen master is measured last (it
holds the lock until the master resumes, which this script does after
``--frozen-s``, from another process).

Run: ``.venv/bin/python benchmarks/bench_mooncake_gil.py``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import threading
import time

import numpy as np
from machine import machine_facts
from mooncake_master import start_master


class Ticker:
    """A thread that ticks every millisecond; ``worst()`` is its longest gap
    since ``reset()``."""

    def __init__(self) -> None:
        self._gaps: list[float] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop:
            now = time.perf_counter()
            self._gaps.append(now - last)
            last = now
            time.sleep(0.001)

    def reset(self) -> None:
        time.sleep(0.02)
        self._gaps = []

    def worst_ms(self) -> float:
        return round(max(self._gaps, default=0.0) * 1e3, 1)

    def stop(self) -> None:
        self._stop = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frozen-s", type=float, default=2.0)
    args = ap.parse_args()
    started = start_master()
    if started is None:
        raise SystemExit("Mooncake is not installed (make setup installs it)")
    master, address = started
    from mooncake.store import MooncakeDistributedStore

    def client(segment: int):
        c = MooncakeDistributedStore()
        assert c.setup("127.0.0.1", "P2PHANDSHAKE", segment, 0, "tcp", "", address) == 0
        return c

    ticker = Ticker()
    result: dict = {"machine": machine_facts(), "healthy": {}, "frozen": {}}

    def on_main(name: str, fn) -> None:
        ticker.reset()
        t = time.perf_counter()
        fn()
        call_ms = round((time.perf_counter() - t) * 1e3, 1)
        time.sleep(0.02)
        gap_ms = ticker.worst_ms()
        result["healthy"][name] = {"call_ms": call_ms, "worst_gap_ms": gap_ms}

    try:
        ticker.reset()
        time.sleep(0.5)
        result["idle_worst_gap_ms"] = ticker.worst_ms()
        holder: dict = {}
        on_main("setup_with_segment", lambda: holder.update(main=client(32 << 20)))
        on_main("setup_without_segment", lambda: holder.update(lane=client(0)))
        main_client, lane = holder["main"], holder["lane"]
        on_main("batch_is_exist", lambda: lane.batch_is_exist(["x"]))
        buf = np.zeros(4096, np.uint8)
        assert main_client.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        main_client.batch_upsert_from(["a"], [buf.ctypes.data], [buf.nbytes])
        main_client.put("p", b"x" * 100)
        on_main("close_without_segment", lane.close)

        os.kill(master.pid, signal.SIGSTOP)
        calls = {
            "batch_is_exist": lambda: main_client.batch_is_exist(["a"]),
            "remove": lambda: main_client.remove("p"),
            "batch_get_into": lambda: main_client.batch_get_into(
                ["a"], [buf.ctypes.data], [buf.nbytes]
            ),
            "batch_upsert_from": lambda: main_client.batch_upsert_from(
                ["b"], [buf.ctypes.data], [buf.nbytes]
            ),
        }
        for name, fn in calls.items():
            ticker.reset()
            th = threading.Thread(target=fn, daemon=True)
            th.start()
            time.sleep(args.frozen_s)
            result["frozen"][name] = {
                "worst_gap_ms": ticker.worst_ms(),
                "still_in_call": th.is_alive(),
            }
        # setup against the frozen master: resumed by another process (a
        # thread of this one could not run while setup holds the lock).
        resume = subprocess.Popen(
            ["sh", "-c", f"sleep {args.frozen_s}; kill -CONT {master.pid}"]
        )
        ticker.reset()
        t = time.perf_counter()
        fresh = MooncakeDistributedStore()
        fresh.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", address)
        result["frozen"]["setup"] = {
            "call_ms": round((time.perf_counter() - t) * 1e3, 1),
            "worst_gap_ms": ticker.worst_ms(),
            "resumed_after_s": args.frozen_s,
        }
        resume.wait()
        fresh.close()
        main_client.unregister_buffer(buf.ctypes.data)
        on_main("close_with_segment", main_client.close)
    finally:
        ticker.stop()
        os.kill(master.pid, signal.SIGCONT)
        master.terminate()
        master.wait()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
