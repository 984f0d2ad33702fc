# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU TEST/DEMO HARNESS ONLY: run vLLM's Triton kernels in Triton's interpreter.

Model Runner V2 (the runner that captures routed experts in vLLM 0.32.0) needs
Triton with a ``cpu`` backend (triton-cpu), which is not on PyPI. This module
registers a stub ``cpu`` backend whose driver is active only under
``TRITON_INTERPRET=1``: every ``@triton.jit`` kernel then runs in Triton's
interpreter on the host. It is slow (about 15 ms a step on a tiny model) and is
meant for tests and the demo on machines without a GPU, never for serving.

``make setup`` installs a ``.pth`` hook that imports this module at interpreter
start-up, so it is active in every process vLLM spawns (API server, EngineCore,
workers). It does nothing unless ``VLLM_FORK_CPU_HARNESS=1``, and nothing when a
real ``cpu`` Triton backend is installed.

With the flag set it also installs ``cpu_parallel`` (what MoE data and expert
parallelism need from the CPU backend: variable-size collectives, experts that
honour the expert map).
"""

from __future__ import annotations

import os

ENV_FLAG = "VLLM_FORK_CPU_HARNESS"


def install() -> bool:
    """Register the interpreter-backed ``cpu`` backend; return True if active."""
    if os.environ.get(ENV_FLAG) != "1":
        return False
    import cpu_parallel

    cpu_parallel.install()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton.backends as tb
        from triton.backends.compiler import BaseBackend, GPUTarget
        from triton.backends.driver import DriverBase
    except ImportError:
        return False
    if "cpu" in tb.backends:
        return False  # a real triton-cpu is installed: use it

    class InterpreterOnlyCompiler(BaseBackend):
        """Claims the ``cpu`` target; compiling is impossible by design."""

        @staticmethod
        def supports_target(target):
            return target.backend == "cpu"

        def hash(self) -> str:
            return "vllm-fork-cpu-harness-interpreter"

        def _unavailable(self, *args, **kwargs):
            raise RuntimeError(
                "vllm-fork CPU harness: Triton kernels only run in the interpreter "
                "(TRITON_INTERPRET=1); there is no compiler for the cpu target"
            )

        parse_options = add_stages = load_dialects = get_module_map = _unavailable

    class InterpreterOnlyDriver(DriverBase):
        """Active only while kernels run in Triton's interpreter."""

        @classmethod
        def is_active(cls):
            return os.environ.get("TRITON_INTERPRET") == "1"

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise RuntimeError("vllm-fork CPU harness: no C++ launcher")

        def get_current_target(self):
            return GPUTarget("cpu", 0, 0)

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            return None

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            import torch

            return torch.cpu

        def get_benchmarker(self):
            from triton.testing import do_bench

            return do_bench

    tb.backends["cpu"] = tb.Backend(
        compiler=InterpreterOnlyCompiler, driver=InterpreterOnlyDriver
    )
    return True


install()
