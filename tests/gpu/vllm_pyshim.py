# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pure-PyTorch stand-ins for the handful of vLLM compiled ops that a tiny
unquantized MoE model needs, so vLLM's Python tree can run on a machine whose
torch does not match the wheel's compiled extensions (no vllm/*.so at all).

Installed by two stub modules that the pack script drops into the copied tree:
    vllm/_C_stable_libtorch.py       -> import vllm_pyshim; vllm_pyshim.install()
    vllm/_moe_C_stable_libtorch.py   -> same
(platforms/cuda.py does `import vllm._C_stable_libtorch` unconditionally.)

Mechanism: torch.ops.<ns> for ns in (_C, _moe_C, _C_cache_ops, _C_cuda_utils)
is replaced by a namespace object whose attributes are plain Python functions;
unknown names fall through to the real torch.ops namespace (so hasattr()
probes behave as without the extension) and are logged once to stderr as
"[pyshim] missing op ns.name" so a run shows which compiled ops were asked for.

The project's copy of ../shared/tools/gpu/vllm_pyshim.py (tests/gpu/
pack_vllm_carry.sh packs this one). Every stand-in is capturable in a CUDA
graph (no host synchronisation, no data-dependent shapes): Model Runner V2
can capture full decode graphs with ``compilation_config={"mode": 0,
"cudagraph_mode": "FULL_DECODE_ONLY"}``. They are not torch.library ops, so
torch.compile (mode > 0) stays out of scope. Changed from the shared copy:
``moe_align_block_size`` counts with ``scatter_add_`` and places tokens with
a scatter into a scratch slot instead of ``bincount`` and boolean indexing,
and ``reshape_and_cache_flash`` sends padding tokens (slot -1) to slot 0,
which is in vLLM's null block (block 0, never handed to a request), instead
of dropping them with a boolean mask; both of those synchronised with the
host, which a capture refuses.

vLLM's own kernels first (issue 39): the wheels' stable-ABI extensions
(``_C_stable_libtorch.abi3.so``, ``_moe_C_stable_libtorch.abi3.so``) load on
the device's torch. When ``tests/gpu/stage_kernels.py unpack`` has put them in
``$VLLM_PYSHIM_KERNELS`` (default ``/tmp/vllm_kernels/<vllm version>``, the
same tree layout as ``vllm/``), ``install()`` loads them with
``torch.ops.load_library`` and registers a stand-in only for an op that is
still missing, printing which ops are vLLM's kernels and which stand-ins, and
why; the first call of each op says which of the two ran.
``VLLM_PYSHIM_KERNELS=0`` keeps every stand-in (the fallback).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.metadata
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

_LOG_MISSING = os.environ.get("VLLM_PYSHIM_QUIET", "0") != "1"
_CALLED: set[str] = set()
_CALLED_KERNELS: set[str] = set()
_MISSING: set[str] = set()


def _note_call(name: str, kernel: bool = False) -> None:
    called = _CALLED_KERNELS if kernel else _CALLED
    if name not in called:
        called.add(name)
        what = "vLLM's kernel" if kernel else "stand-in"
        print(f"[pyshim] first call of {name} ({what})", file=sys.stderr, flush=True)


class _PyOp:
    def __init__(self, qualname, fn):
        self._qualname = qualname
        self._fn = fn
        self.__name__ = qualname.split(".")[-1]

    def __call__(self, *args, **kwargs):
        _note_call(self._qualname)
        return self._fn(*args, **kwargs)

    @property
    def default(self):
        return self

    def __repr__(self):
        return f"<pyshim op {self._qualname}>"


class _KernelOp:
    """A compiled op of a loaded library, as torch.ops gives it, noting its
    first call; overloads and attributes (``.default``, ``._schema``) are the
    real op's."""

    def __init__(self, qualname, packet):
        self._qualname = qualname
        self._packet = packet
        self.__name__ = qualname.split(".")[-1]

    def __call__(self, *args, **kwargs):
        _note_call(self._qualname, kernel=True)
        return self._packet(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._packet, name)

    def __repr__(self):
        return f"<vLLM kernel {self._qualname}>"


class _ShimNamespace:
    def __init__(self, name: str, real):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_ops", {})

    def _add(self, fn, name=None):
        name = name or fn.__name__
        self._ops[name] = _PyOp(f"{self._name}.{name}", fn)
        return fn

    def __getattr__(self, op):
        ops = object.__getattribute__(self, "_ops")
        if op in ops:
            return ops[op]
        if op.startswith("__"):
            raise AttributeError(op)
        try:
            real = getattr(object.__getattribute__(self, "_real"), op)
        except (AttributeError, RuntimeError):
            key = f"{self._name}.{op}"
            if _LOG_MISSING and key not in _MISSING:
                _MISSING.add(key)
                print(f"[pyshim] missing op {key}", file=sys.stderr, flush=True)
            raise AttributeError(key) from None
        kernel = _KernelOp(f"{self._name}.{op}", real)
        ops[op] = kernel
        return kernel

    def __dir__(self):
        return sorted(self._ops)


_INSTALLED = False
NS: dict[str, _ShimNamespace] = {}


def _ns(name: str) -> _ShimNamespace:
    if name not in NS:
        real = getattr(torch.ops, name)  # the real (lazily created) namespace
        if isinstance(real, _ShimNamespace):
            real = object.__getattribute__(real, "_real")
        ns = _ShimNamespace(name, real)
        setattr(torch.ops, name, ns)
        NS[name] = ns
    return NS[name]


# ----------------------------------------------------------------------------
# _C: activations, norms, rope, UVA view, misc
# ----------------------------------------------------------------------------


def silu_and_mul(out, x):
    d = x.shape[-1] // 2
    out.copy_(F.silu(x[..., :d]) * x[..., d:])


def mul_and_silu(out, x):
    d = x.shape[-1] // 2
    out.copy_(x[..., :d] * F.silu(x[..., d:]))


def gelu_and_mul(out, x):
    d = x.shape[-1] // 2
    out.copy_(F.gelu(x[..., :d]) * x[..., d:])


def gelu_tanh_and_mul(out, x):
    d = x.shape[-1] // 2
    out.copy_(F.gelu(x[..., :d], approximate="tanh") * x[..., d:])


def silu_and_mul_with_clamp(out, x, limit, alpha=1.0, beta=0.0):
    d = x.shape[-1] // 2
    g = x[..., :d].float().clamp(max=limit)
    u = x[..., d:].float().clamp(min=-limit, max=limit)
    out.copy_((F.silu(g) * (u * alpha + beta)).to(out.dtype))


def _rms(xf, weight, eps, dtype):
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    y = (xf * torch.rsqrt(var + eps)).to(dtype)
    if weight is not None:
        y = y * weight
    return y


def rms_norm(out, x, weight, epsilon):
    out.copy_(_rms(x.float(), weight, epsilon, x.dtype))


def fused_add_rms_norm(x, residual, weight, epsilon):
    z = x + residual
    residual.copy_(z)
    x.copy_(_rms(z.float(), weight, epsilon, x.dtype))


def _rope_apply(xr, cos, sin, is_neox):
    # xr: [n, h, rot], cos/sin: [n, 1, rot/2] (fp32)
    if is_neox:
        x1, x2 = xr.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1 = xr[..., ::2]
    x2 = xr[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def rotary_embedding(
    positions,
    query,
    key,
    head_size,
    cos_sin_cache,
    is_neox,
    rope_dim_offset=0,
    inverse=False,
):
    pos = positions.flatten()
    n = pos.shape[0]
    rot = cos_sin_cache.shape[-1]
    cs = cos_sin_cache.index_select(0, pos).float()
    cos, sin = cs.chunk(2, dim=-1)
    if inverse:
        sin = -sin
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    for t in (query, key):
        if t is None:
            continue
        tv = t.view(n, -1, head_size)
        xr = tv[..., rope_dim_offset : rope_dim_offset + rot]
        xr.copy_(_rope_apply(xr.float(), cos, sin, is_neox).to(t.dtype))


_UVA_MODE = None


def _uva_view_dlpack(cpu_tensor: torch.Tensor) -> torch.Tensor:
    """CUDA tensor aliasing pinned host memory (what vLLM's
    get_cuda_view_from_cpu_tensor does with cudaHostGetDevicePointer).
    Under UVA, cudaHostAlloc'ed memory has the same address on the device, so
    re-label the CPU tensor's DLPack capsule as kDLCUDA and import it; the
    capsule's deleter keeps the CPU tensor alive."""
    dev = torch.cuda.current_device()
    cap = torch.utils.dlpack.to_dlpack(cpu_tensor)
    get_ptr = ctypes.pythonapi.PyCapsule_GetPointer
    get_ptr.restype = ctypes.c_void_p
    get_ptr.argtypes = [ctypes.py_object, ctypes.c_char_p]
    p = get_ptr(cap, b"dltensor")
    # DLManagedTensor.dl_tensor: {void* data; DLDevice{int32 type; int32 id}; ...}
    ctypes.c_int32.from_address(p + 8).value = 2  # kDLCUDA
    ctypes.c_int32.from_address(p + 12).value = dev
    return torch.utils.dlpack.from_dlpack(cap)


def get_cuda_view_from_cpu_tensor(cpu_tensor):
    global _UVA_MODE
    assert cpu_tensor.device.type == "cpu"
    if cpu_tensor.numel() == 0:
        return torch.empty(cpu_tensor.shape, dtype=cpu_tensor.dtype, device="cuda")
    if not cpu_tensor.is_pinned():
        raise RuntimeError("get_cuda_view_from_cpu_tensor: tensor is not pinned")
    v = _uva_view_dlpack(cpu_tensor)
    if _UVA_MODE is None:
        _UVA_MODE = "dlpack"
        print(
            f"[pyshim] UVA view via DLPack relabel: cpu_ptr={cpu_tensor.data_ptr():#x}"
            f" cuda_ptr={v.data_ptr():#x} dev={v.device}",
            file=sys.stderr,
            flush=True,
        )
    return v


def weak_ref_tensor(t):
    # Not weak (keeps storage alive); only used on CUDA-graph paths.
    return t.as_strided(t.size(), t.stride(), t.storage_offset())


def greedy_argmax(logits):
    return logits.argmax(dim=-1).view(-1)


# ----------------------------------------------------------------------------
# _moe_C: routing, alignment, reduction
# ----------------------------------------------------------------------------


def _token_expert_indices(out, m, k):
    if out is None:
        return
    ar_k = torch.arange(k, device=out.device, dtype=torch.int64)
    ar_m = torch.arange(m, device=out.device, dtype=torch.int64)
    out.copy_((ar_k[None, :] * m + ar_m[:, None]).to(out.dtype))


def _topk_common(
    scores, topk_weights, topk_ids, token_expert_indices, renormalize, bias, scale
):
    k = topk_weights.shape[-1]
    sel = scores + bias.float() if bias is not None else scores
    _, ids = torch.topk(sel, k, dim=-1)
    w = scores.gather(-1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    if scale != 1.0:
        w = w * scale
    topk_weights.copy_(w.to(topk_weights.dtype))
    topk_ids.copy_(ids.to(topk_ids.dtype))
    _token_expert_indices(token_expert_indices, scores.shape[0], k)


def topk_softmax(
    topk_weights,
    topk_ids,
    token_expert_indices,
    gating_output,
    renormalize=False,
    e_score_correction_bias=None,
    is_padding=None,
):
    scores = torch.softmax(gating_output.float(), dim=-1)
    _topk_common(
        scores,
        topk_weights,
        topk_ids,
        token_expert_indices,
        renormalize,
        e_score_correction_bias,
        1.0,
    )


def topk_sigmoid(
    topk_weights,
    topk_ids,
    token_expert_indices,
    gating_output,
    renormalize=False,
    e_score_correction_bias=None,
    routed_scaling_factor=1.0,
    is_padding=None,
):
    scores = torch.sigmoid(gating_output.float())
    _topk_common(
        scores,
        topk_weights,
        topk_ids,
        token_expert_indices,
        renormalize,
        e_score_correction_bias,
        routed_scaling_factor,
    )


def moe_align_block_size(
    topk_ids,
    num_experts,
    block_size,
    sorted_token_ids,
    experts_ids,
    num_tokens_post_pad,
    expert_map=None,
    scatter_idx=None,
):
    """Same contract as csrc/moe/moe_align_sum_kernels.cu, vectorised, no host
    sync: per-expert segments padded to block_size, pad slots = numel, blocks
    past the end get expert -1."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    if expert_map is not None:
        local = torch.where(valid, expert_map[flat.clamp(0, num_experts - 1)], -1)
        valid = valid & (local >= 0)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    cum_padded = torch.cumsum(padded, 0)
    seg_start = cum_padded - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    skey = key[order]
    svalid = skey < num_experts
    skey_c = skey.clamp(max=num_experts - 1)
    rank = torch.arange(n, device=dev) - cnt_start[skey_c]
    dest = seg_start[skey_c] + rank
    # Invalid entries go to a scratch slot past the end, then dropped.
    size = sorted_token_ids.numel()
    placed = torch.full((size + 1,), n, dtype=sorted_token_ids.dtype, device=dev)
    placed.scatter_(
        0,
        torch.where(svalid, dest, torch.full_like(dest, size)),
        order.to(sorted_token_ids.dtype),
    )
    sorted_token_ids.copy_(placed[:size])
    total = cum_padded[-1:] if num_experts > 0 else torch.zeros(1, device=dev)
    num_tokens_post_pad.copy_(total.to(num_tokens_post_pad.dtype))
    nblk = experts_ids.numel()
    blk_start = torch.arange(nblk, device=dev, dtype=torch.int64) * block_size
    e = torch.searchsorted(cum_padded, blk_start, right=True)
    e = torch.where(e < num_experts, e, torch.full_like(e, -1))
    if expert_map is not None:
        e = torch.where(e >= 0, expert_map[e.clamp(min=0)].to(torch.int64), e)
    experts_ids.copy_(e.to(experts_ids.dtype))
    if scatter_idx is not None:
        ar = torch.arange(n, device=dev, dtype=torch.int64)
        scatter_idx.copy_(torch.where(valid, ar, -1).view(-1, 1).to(scatter_idx.dtype))


def moe_sum(inp, output, topk_ids=None, expert_map=None):
    if topk_ids is not None and expert_map is not None:
        keep = expert_map[topk_ids.long()] >= 0
        inp = inp * keep.unsqueeze(-1).to(inp.dtype)
    output.copy_(inp.sum(dim=1).to(output.dtype))


def moe_permute_unpermute_supported():
    return False


# ----------------------------------------------------------------------------
# _C_cache_ops / _C_cuda_utils (FLEX_ATTENTION path, misc queries)
# ----------------------------------------------------------------------------


def reshape_and_cache_flash(
    key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
):
    bs = key_cache.shape[1]
    n = slot_mapping.shape[0]
    slots = slot_mapping.long()
    # Padding tokens (slot -1) write into slot 0, in the null block (block 0
    # is never given to a request), so no boolean mask syncs with the host.
    s = torch.where(slots >= 0, slots, torch.zeros_like(slots))
    blk, off = s // bs, s % bs
    key_cache[blk, off] = key[:n].to(key_cache.dtype)
    value_cache[blk, off] = value[:n].to(value_cache.dtype)


_CUDART = None


def _cudart():
    """libcudart through ctypes (torch's own copy), for raw-pointer copies."""
    global _CUDART
    if _CUDART is None:
        import ctypes.util
        import glob

        here = os.path.dirname(torch.__file__)
        roots = [here, os.path.dirname(here)]
        found = [
            f
            for r in roots
            for f in glob.glob(os.path.join(r, "**", "libcudart.so*"), recursive=True)
        ] + [ctypes.util.find_library("cudart") or ""]
        lib = ctypes.CDLL(next(f for f in found if f))
        ptr, size = ctypes.c_void_p, ctypes.c_size_t
        lib.cudaMemcpyAsync.argtypes = [ptr, ptr, size, ctypes.c_int, ptr]
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        _CUDART = lib
    return _CUDART


def swap_blocks_batch(src_ptrs, dst_ptrs, sizes, is_src_access_order_any=False):
    """CPU KV offload's copies (raw pointers, host pinned or device): one
    cudaMemcpyAsync (cudaMemcpyDefault) each on the current stream."""
    lib = _cudart()
    stream = torch.cuda.current_stream().cuda_stream
    for s, d, n in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()):
        rc = lib.cudaMemcpyAsync(d, s, n, 4, stream)
        if rc != 0:
            raise RuntimeError(f"cudaMemcpyAsync failed: {rc}")


def vocab_parallel_embedding(
    out, input_ids, weight, org_start, org_end, num_org_padding, added_start, added_end
):
    """TP > 1 embedding lookup: this rank's rows, zeros for ids it does not own
    (same arithmetic as vLLM's get_masked_input_and_mask)."""
    ids = input_ids.long()
    org = (ids >= org_start) & (ids < org_end)
    added = (ids >= added_start) & (ids < added_end)
    added_offset = added_start - (org_end - org_start) - num_org_padding
    local = ids - (org_start * org + added_offset * added)
    valid = org | added
    rows = weight[torch.where(valid, local, torch.zeros_like(local))]
    out.copy_(rows * valid.unsqueeze(-1).to(rows.dtype))


def get_max_shared_memory_per_block_device_attribute(device):
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def _false(*args, **kwargs):
    return False


# capability queries answered "no" (no CUTLASS/Machete kernels without the .so)
_C_FALSE_QUERIES = (
    "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_fp4",
    "cutlass_group_gemm_supported",
    "mxfp4_experts_quant_supported",
    "is_onednn_acl_supported",
)


# vLLM 0.34's router linear (GateLinear) picks CuTe DSL kernels on Hopper and
# Blackwell and registers their warm-up when it is built; the DSL (the
# nvidia-cutlass-dsl wheel) is not on the device machine. The harness builds
# every GateLinear as on another GPU, so it runs the plain linear, as 0.32's
# did; the base and the fork get the same (both trees load this shim).
_GATE_LINEAR = "vllm.model_executor.layers.fused_moe.router.gate_linear"


class _NoSpecialisedGemm:
    """The platform, except that no device capability matches."""

    def __init__(self, platform):
        self._platform = platform

    def is_device_capability(self, *args, **kwargs):
        return False

    def is_device_capability_family(self, *args, **kwargs):
        return False

    def __getattr__(self, name):
        return getattr(self._platform, name)


def _plain_gate_linear(module) -> None:
    cls = getattr(module, "GateLinear", None)
    if cls is None:
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        platform = module.current_platform
        module.current_platform = _NoSpecialisedGemm(platform)
        try:
            init(self, *args, **kwargs)
        finally:
            module.current_platform = platform

    cls.__init__ = __init__
    print("[pyshim] GateLinear: plain linear (no CuTe DSL)", file=sys.stderr)


class _PatchOnImport:
    """A meta-path finder that lets ``name`` load as usual, then calls
    ``patch(module)``."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        patch = self.patch

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


# vLLM 0.34's kernel warm-up imports MiniMax M3's MSA warm-up on every CUDA
# run, and its modules import the CuTe DSL: a no-op stands in (the harness
# serves other models; on 0.32 the name is unused).
_MSA_WARMUP = "vllm.model_executor.warmup.minimax_m3_msa_warmup"


# ----------------------------------------------------------------------------
# vLLM's own kernels: the wheel's stable-ABI libraries, where staged
# ----------------------------------------------------------------------------

KERNELS_ENV = "VLLM_PYSHIM_KERNELS"
# The libraries the stand-ins' namespaces live in, relative to vllm/.
LIBRARIES = ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so")
LIBRARY_OF_NAMESPACE = {
    "_C": LIBRARIES[0],
    "_C_cache_ops": LIBRARIES[0],
    "_C_cuda_utils": LIBRARIES[0],
    "_moe_C": LIBRARIES[1],
}
# library -> "loaded", or why it is not (the reason its ops' stand-ins give)
LIBRARY_STATUS: dict[str, str] = {}
KERNEL_OPS: list[str] = []
STAND_INS: dict[str, str] = {}  # op -> why it is a stand-in


def kernels_dir() -> str | None:
    """Where the staged libraries are: $VLLM_PYSHIM_KERNELS (``0``: none,
    stand-ins only), else /tmp/vllm_kernels/<the vllm version on the path>."""
    value = os.environ.get(KERNELS_ENV)
    if value == "0":
        return None
    if value:
        return value
    try:
        return f"/tmp/vllm_kernels/{importlib.metadata.version('vllm')}"
    except importlib.metadata.PackageNotFoundError:
        return None


def load_library(relpath: str, directory: str | None) -> str:
    """Load one staged library with torch.ops.load_library: "loaded", or why
    not."""
    if directory is None:
        return f"stand-ins only ({KERNELS_ENV}=0)"
    path = os.path.join(directory, relpath)
    if not os.path.isfile(path):
        return f"not staged ({path} absent)"
    try:
        torch.ops.load_library(path)
    except Exception as e:  # the reason is reported, the stand-in serves
        return f"failed to load: {type(e).__name__}: {str(e)[:300]}"
    return "loaded"


def _real_has(ns: str, op: str) -> bool:
    real = getattr(torch.ops, ns)
    if isinstance(real, _ShimNamespace):
        real = object.__getattribute__(real, "_real")
    try:
        getattr(real, op)
    except (AttributeError, RuntimeError):
        return False
    return True


def plan(
    wanted: dict[str, list[str]],
    has_kernel: Callable[[str, str], bool],
    library_status: dict[str, str],
) -> tuple[list[str], dict[str, str]]:
    """Split the ops that have stand-ins (namespace -> names) into those a
    loaded library provides and those that need their stand-in, with why."""
    kernels, stand_ins = [], {}
    for ns, names in wanted.items():
        lib = LIBRARY_OF_NAMESPACE[ns]
        status = library_status.get(lib, "not looked for")
        for name in names:
            qualname = f"{ns}.{name}"
            if status == "loaded" and has_kernel(ns, name):
                kernels.append(qualname)
            elif status == "loaded":
                stand_ins[qualname] = f"not in {lib}"
            else:
                stand_ins[qualname] = f"{lib}: {status}"
    return kernels, stand_ins


def report() -> dict:
    """What this process has: libraries, kernels and stand-ins (with why),
    and which of them were called."""
    return {
        "kernels_dir": kernels_dir(),
        "libraries": dict(LIBRARY_STATUS),
        "kernel_ops": list(KERNEL_OPS),
        "stand_ins": dict(STAND_INS),
        "called_kernels": sorted(_CALLED_KERNELS),
        "called_stand_ins": sorted(_CALLED),
        "missing": sorted(_MISSING),
    }


def _print_calls() -> None:
    print(
        f"[pyshim] ran as vLLM's kernels: {sorted(_CALLED_KERNELS)}; "
        f"ran as stand-ins: {sorted(_CALLED)}",
        file=sys.stderr,
        flush=True,
    )


def _stand_in_table() -> dict[str, list[tuple[str, Callable]]]:
    c: list[tuple[str, Callable]] = [
        (fn.__name__, fn)
        for fn in (
            silu_and_mul,
            mul_and_silu,
            gelu_and_mul,
            gelu_tanh_and_mul,
            silu_and_mul_with_clamp,
            rms_norm,
            fused_add_rms_norm,
            rotary_embedding,
            get_cuda_view_from_cpu_tensor,
            weak_ref_tensor,
            greedy_argmax,
            vocab_parallel_embedding,
        )
    ]
    c += [(q, _false) for q in _C_FALSE_QUERIES]
    moe = [
        (fn.__name__, fn)
        for fn in (
            topk_softmax,
            topk_sigmoid,
            moe_align_block_size,
            moe_sum,
            moe_permute_unpermute_supported,
        )
    ]
    cache: list[tuple[str, Callable]] = [
        ("reshape_and_cache_flash", reshape_and_cache_flash),
        ("swap_blocks_batch", swap_blocks_batch),
    ]
    utils: list[tuple[str, Callable]] = [
        (
            "get_max_shared_memory_per_block_device_attribute",
            get_max_shared_memory_per_block_device_attribute,
        )
    ]
    return {"_C": c, "_moe_C": moe, "_C_cache_ops": cache, "_C_cuda_utils": utils}


def import_flash_attn(name: str, required: bool) -> None:
    """Body of the packed tree's vllm/vllm_flash_attn/<name>.py: load the
    staged FlashAttention library; without it, raise ImportError when
    ``required`` (FA3: vLLM then reports it unavailable, as without the
    module) or leave an empty module (FA2, as the harness always had)."""
    relpath = f"vllm_flash_attn/{name}.abi3.so"
    status = load_library(relpath, kernels_dir())
    LIBRARY_STATUS[relpath] = status
    print(f"[pyshim] library {relpath}: {status}", file=sys.stderr, flush=True)
    if status != "loaded" and required:
        raise ImportError(f"{name}: {status}")


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    if _MSA_WARMUP not in sys.modules:
        import types

        stub = types.ModuleType(_MSA_WARMUP)
        stub.minimax_m3_msa_warmup = lambda worker: None  # type: ignore[attr-defined]
        sys.modules[_MSA_WARMUP] = stub
    if _GATE_LINEAR in sys.modules:
        _plain_gate_linear(sys.modules[_GATE_LINEAR])
    else:
        sys.meta_path.insert(0, _PatchOnImport(_GATE_LINEAR, _plain_gate_linear))
    directory = kernels_dir()
    for lib in LIBRARIES:
        LIBRARY_STATUS[lib] = load_library(lib, directory)
        print(f"[pyshim] library {lib}: {LIBRARY_STATUS[lib]}", file=sys.stderr)
    table = _stand_in_table()
    kernels, stand_ins = plan(
        {ns: [name for name, _ in ops] for ns, ops in table.items()},
        _real_has,
        LIBRARY_STATUS,
    )
    KERNEL_OPS[:] = kernels
    STAND_INS.clear()
    STAND_INS.update(stand_ins)
    for ns, ops in table.items():
        shim_ns = _ns(ns)
        for name, fn in ops:
            if f"{ns}.{name}" in stand_ins:
                shim_ns._add(fn, name)
    print(
        f"[pyshim] vLLM's kernels for {len(kernels)} ops: {', '.join(kernels)}",
        file=sys.stderr,
    )
    for op, why in stand_ins.items():
        print(f"[pyshim] stand-in {op}: {why}", file=sys.stderr)
    atexit.register(_print_calls)
    print(
        f"[pyshim] installed: {len(kernels)} ops as vLLM's kernels, "
        f"{len(stand_ins)} pure-torch stand-ins (torch {torch.__version__})",
        file=sys.stderr,
        flush=True,
    )
