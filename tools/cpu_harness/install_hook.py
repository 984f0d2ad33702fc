# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Install the CPU harness's start-up hook into the running interpreter's venv.

Writes ``vllm_fork_cpu_harness.pth`` into site-packages: it puts this folder on
``sys.path`` and imports ``vllm_fork_cpu_harness``, which does nothing unless
``VLLM_FORK_CPU_HARNESS=1`` (see that module). A ``.pth`` hook is the one place
that runs in every process vLLM spawns, whatever the start method.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    pth = site / "vllm_fork_cpu_harness.pth"
    text = f"{HERE}\nimport vllm_fork_cpu_harness\n"
    if not pth.exists() or pth.read_text() != text:
        pth.write_text(text)
        print(f"[setup] installed {pth.name} (inert unless VLLM_FORK_CPU_HARNESS=1)")


if __name__ == "__main__":
    main()
