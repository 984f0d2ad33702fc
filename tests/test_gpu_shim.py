# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GPU harness's capturable stand-ins (tests/gpu/vllm_pyshim.py), on the
CPU, against plain-Python references of the compiled ops' contracts
(csrc/moe/moe_align_sum_kernels.cu, csrc/cache_kernels.cu). The functions
are called directly: ``install()`` would replace torch.ops namespaces of
this process. That they capture in a CUDA graph is shown on the device
(tests/gpu, the ``graphs`` cases)."""

import importlib.util
from pathlib import Path

import pytest
import torch

SHIM = Path(__file__).resolve().parent / "gpu" / "vllm_pyshim.py"
_spec = importlib.util.spec_from_file_location("vllm_pyshim_under_test", SHIM)
assert _spec is not None and _spec.loader is not None
shim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shim)


def _align_reference(flat: list[int], num_experts: int, bs: int, expert_map=None):
    """Per local expert in order: its tokens' indices, padded with ``n`` to
    a multiple of ``bs``; one expert id per block."""
    n = len(flat)
    ids, experts = [], []
    for e in range(num_experts):
        if expert_map is not None and expert_map[e] < 0:
            continue
        toks = [i for i, x in enumerate(flat) if x == e]
        if not toks:
            continue
        pad = (len(toks) + bs - 1) // bs * bs
        ids += toks + [n] * (pad - len(toks))
        local = e if expert_map is None else expert_map[e]
        experts += [local] * (pad // bs)
    return ids, experts


@pytest.mark.parametrize(
    "m,k,num_experts,bs,with_map,with_invalid",
    [
        (5, 2, 8, 16, False, False),
        (37, 2, 8, 16, False, True),
        (100, 4, 64, 64, True, False),
        (1, 2, 8, 16, False, False),
        (64, 8, 128, 32, True, True),
    ],
)
def test_moe_align_block_size_matches_the_kernel_contract(
    m, k, num_experts, bs, with_map, with_invalid
):
    g = torch.Generator().manual_seed(m * 1000 + num_experts)
    ids = torch.stack(
        [torch.randperm(num_experts, generator=g)[:k] for _ in range(m)]
    ).int()
    if with_invalid:
        ids[0, 0] = -1  # a token routed nowhere (EP: another rank's expert)
    expert_map = None
    if with_map:
        # Every other expert is local, renumbered 0..E/2-1.
        expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
        expert_map[::2] = torch.arange((num_experts + 1) // 2, dtype=torch.int32)
    max_pad = ids.numel() + num_experts * (bs - 1)
    sorted_ids = torch.full((max_pad,), -7, dtype=torch.int32)
    experts = torch.full(((max_pad + bs - 1) // bs,), -7, dtype=torch.int32)
    total = torch.zeros(1, dtype=torch.int32)
    shim.moe_align_block_size(
        ids, num_experts, bs, sorted_ids, experts, total, expert_map, None
    )
    want_ids, want_experts = _align_reference(
        ids.flatten().tolist(),
        num_experts,
        bs,
        None if expert_map is None else expert_map.tolist(),
    )
    t = int(total.item())
    assert t == len(want_ids)
    assert sorted_ids[:t].tolist() == want_ids
    assert (sorted_ids[t:] == ids.numel()).all()
    assert experts[: t // bs].tolist() == want_experts
    assert (experts[t // bs :] == -1).all()


def test_reshape_and_cache_flash_writes_real_slots_and_pads_into_the_null_block():
    num_blocks, bs, heads, dim = 4, 8, 2, 3
    key_cache = torch.zeros(num_blocks, bs, heads, dim)
    value_cache = torch.zeros(num_blocks, bs, heads, dim)
    slots = torch.tensor([9, 17, -1, 31, -1], dtype=torch.int64)
    key = torch.randn(5, heads, dim)
    value = torch.randn(5, heads, dim)
    shim.reshape_and_cache_flash(
        key, value, key_cache, value_cache, slots, "auto", None, None
    )
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(key_cache[s // bs, s % bs], key[i])
            assert torch.equal(value_cache[s // bs, s % bs], value[i])
    # Nothing else of a request's blocks (1-3) was touched.
    written = {s for s in slots.tolist() if s >= 0}
    for s in range(bs, num_blocks * bs):
        if s not in written:
            assert not key_cache[s // bs, s % bs].any()
            assert not value_cache[s // bs, s % bs].any()


# ------------------------------------------- vLLM's own kernels, where staged


def test_plan_takes_the_kernel_where_the_library_has_it_else_the_stand_in():
    """An op of a loaded library is vLLM's kernel; an op that library lacks,
    or one whose library did not load, gets its stand-in, with the reason."""
    status = {
        "_C_stable_libtorch.abi3.so": "loaded",
        "_moe_C_stable_libtorch.abi3.so": "not staged (/x absent)",
    }
    present = {("_C", "rms_norm")}
    kernels, stand_ins = shim.plan(
        {"_C": ["rms_norm", "greedy_argmax"], "_moe_C": ["topk_softmax"]},
        lambda ns, op: (ns, op) in present,
        status,
    )
    assert kernels == ["_C.rms_norm"]
    assert stand_ins == {
        "_C.greedy_argmax": "not in _C_stable_libtorch.abi3.so",
        "_moe_C.topk_softmax": "_moe_C_stable_libtorch.abi3.so: not staged (/x absent)",
    }


def test_load_library_says_why_a_library_does_not_serve(tmp_path, monkeypatch):
    """Stand-ins only, nothing staged, or a file that is no library: each a
    reason, never an exception (the stand-in then serves)."""
    assert shim.load_library("lib.so", None).startswith("stand-ins only")
    assert shim.load_library("lib.so", str(tmp_path)).startswith("not staged")
    (tmp_path / "lib.so").write_bytes(b"not an ELF file")
    assert shim.load_library("lib.so", str(tmp_path)).startswith("failed to load:")
    monkeypatch.setenv(shim.KERNELS_ENV, "0")
    assert shim.kernels_dir() is None
    monkeypatch.setenv(shim.KERNELS_ENV, str(tmp_path))
    assert shim.kernels_dir() == str(tmp_path)
