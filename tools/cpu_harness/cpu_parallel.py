# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU TEST/DEMO HARNESS ONLY: what MoE data and expert parallelism need on
vLLM 0.32.0's CPU backend, so that ``--data-parallel-size 2`` and
``--enable-expert-parallel`` engines run on the CPU harness.

Two gaps of the base, both outside the R3 path:

1. **Data parallelism.** The MoE layers exchange tokens between the
   data-parallel ranks with the all-gather / reduce-scatter "all2all"
   manager (``AgRsAll2AllManager``, the only one the CPU communicator
   offers). It calls ``all_gatherv`` (dispatch: every rank gets every rank's
   tokens) and ``reduce_scatterv`` (combine: every rank gets the sum of the
   expert outputs for its own tokens), with one token count per rank.
   ``CpuCommunicator`` inherits both from ``DeviceCommunicatorBase``, where
   they raise ``NotImplementedError``: the first forward of a DP engine
   fails. Here ``CpuCommunicator`` gets them on its ``torch.distributed``
   (gloo) group:

   * ``all_gatherv``: each tensor is zero-padded along dim 0 to the largest
     count, all-gathered (``dist.all_gather``), and each rank's rows cut out
     again, in rank order;
   * ``reduce_scatterv``: the whole ``[sum(sizes), ...]`` tensor is
     all-reduced (sum) and this rank keeps its own rows. It moves
     ``world_size`` times the bytes a real reduce-scatter would, which does
     not matter for a tiny test model; with two ranks the sum ``a + b`` is
     the same on both ranks.

2. **Expert parallelism.** With ``enable_expert_parallel`` each rank holds
   only its experts' weights, and the modular kernel hands the experts the
   router's global expert IDs plus an ``expert_map`` (global ID -> local
   slot, -1 where another rank holds the expert).
   ``CPUUnquantizedExperts.apply`` ignores the map and passes the global IDs
   to ``cpu_fused_moe``, which indexes past the local weights (a segfault
   in ``cpu_fused_moe.cpp`` on the first forward). Here ``apply`` maps the
   IDs first; a pair whose expert lives on another rank gets weight 0 and
   local slot 0, so it adds nothing and that rank adds its part (the EP
   group's reduction sums the ranks). The router's output, which R3
   captures, is upstream of this: the captured IDs stay the global,
   logical ones.

Like the Triton stub, this is installed from the ``.pth`` hook in every
process vLLM spawns and does nothing unless ``VLLM_FORK_CPU_HARNESS=1``. It
does not import vLLM: it waits for the two modules to be imported and then
patches their classes, only where the base still has the gap (a base that
implements the collectives keeps its own; the experts are patched once).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

COMMUNICATOR = "vllm.distributed.device_communicators.cpu_communicator"
EXPERTS = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"
MARK = "_vllm_fork_cpu_harness_parallel"


# ----------------------------------------------------------------- the ops
def _check_sizes(comm, sizes, n_local: int) -> list[int]:
    if sizes is None:
        return [n_local] * comm.world_size
    sizes = [int(s) for s in sizes]
    assert len(sizes) == comm.world_size, (sizes, comm.world_size)
    return sizes


def all_gatherv(self, input_, dim: int = 0, sizes=None):
    """``[sizes[r], ...]`` on every rank ``r`` -> ``[sum(sizes), ...]`` on
    every rank, rows in rank order; a list of tensors gives a list."""
    import torch
    import torch.distributed as dist

    if dim != 0:
        raise NotImplementedError("only dim 0 all-gatherv is supported")
    single = isinstance(input_, torch.Tensor)
    tensors = [input_] if single else list(input_)
    if self.world_size == 1:
        return input_ if single else tensors
    outputs = []
    for t in tensors:
        counts = _check_sizes(self, sizes, t.shape[0])
        assert t.shape[0] == counts[self.rank_in_group], (t.shape, counts)
        width = max(counts)
        padded = t.new_zeros((width, *t.shape[1:]))
        padded[: t.shape[0]].copy_(t)
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=self.device_group)
        outputs.append(torch.cat([p[:n] for p, n in zip(parts, counts)], dim=0))
    return outputs[0] if single else outputs


def reduce_scatterv(self, input_, dim: int = -1, sizes=None):
    """``[sum(sizes), ...]`` on every rank -> the sum over ranks of this
    rank's rows ``[sizes[rank], ...]``."""
    import torch.distributed as dist

    if self.world_size == 1:
        return input_
    if dim < 0:
        dim += input_.dim()
    full = input_.movedim(0, dim).contiguous() if dim else input_.clone()
    if sizes is None:
        assert full.shape[0] % self.world_size == 0, full.shape
        sizes = [full.shape[0] // self.world_size] * self.world_size
    counts = _check_sizes(self, sizes, 0)
    assert full.shape[0] == sum(counts), (full.shape, counts)
    dist.all_reduce(full, group=self.device_group)
    start = sum(counts[: self.rank_in_group])
    mine = full[start : start + counts[self.rank_in_group]]
    return mine.movedim(0, dim).contiguous() if dim else mine.contiguous()


def reduce_scatterv_into_output(self, input_, output, dim: int = -1, sizes=None):
    output.copy_(reduce_scatterv(self, input_, dim, sizes))
    return output


def patch_communicator(cls) -> bool:
    """Give ``cls`` (``CpuCommunicator``) the ops it lacks; True if any."""
    if getattr(cls, MARK, False):
        return False
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase as Base,
    )

    ops = {
        "all_gatherv": all_gatherv,
        "reduce_scatterv": reduce_scatterv,
        "reduce_scatterv_into_output": reduce_scatterv_into_output,
    }
    changed = False
    for name, fn in ops.items():
        # Only where the class still has the base's (unimplemented) one.
        if getattr(cls, name) is getattr(Base, name):
            setattr(cls, name, fn)
            changed = True
    setattr(cls, MARK, True)
    return changed


# ----------------------------------------------------------------- experts
def local_expert_ids(topk_weights, topk_ids, expert_map):
    """The router's global IDs as this rank's local slots: a pair whose
    expert another rank holds gets weight 0 and slot 0."""
    import torch

    local = expert_map[topk_ids.long()]
    foreign = local < 0
    weights = torch.where(foreign, torch.zeros_like(topk_weights), topk_weights)
    ids = torch.where(foreign, torch.zeros_like(local), local).to(topk_ids.dtype)
    return weights, ids


def patch_experts(cls) -> bool:
    """Make ``cls.apply`` (``CPUUnquantizedExperts``) honour ``expert_map``."""
    if cls.__dict__.get(MARK, False):
        return False
    apply = cls.apply

    def apply_with_expert_map(
        self, output, hidden_states, w1, w2, topk_weights, topk_ids,
        activation, global_num_experts, expert_map, *args, **kwargs,
    ):  # fmt: skip
        if expert_map is not None:
            topk_weights, topk_ids = local_expert_ids(
                topk_weights, topk_ids, expert_map
            )
        return apply(
            self, output, hidden_states, w1, w2, topk_weights, topk_ids,
            activation, global_num_experts, None, *args, **kwargs,
        )  # fmt: skip

    setattr(apply_with_expert_map, "__wrapped__", apply)  # noqa: B010
    cls.apply = apply_with_expert_map
    setattr(cls, MARK, True)
    return True


# ----------------------------------------------------------------- the hook
PATCHES = {
    COMMUNICATOR: lambda module: patch_communicator(module.CpuCommunicator),
    EXPERTS: lambda module: patch_experts(module.CPUUnquantizedExperts),
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches a module's classes right after the module is executed."""

    def find_spec(self, fullname, path, target=None):
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        setattr(loader, "exec_module", exec_and_patch)  # noqa: B010
        return spec


def install() -> bool:
    """Patch the modules already loaded now, the others when imported."""
    for name, patch in PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
    return True
