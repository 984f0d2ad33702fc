# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's own compiled kernels for the GPU harness (issue 39): the CUDA
wheel's stable-ABI extensions, carried to the device in separate calls.

One call carries at most 64 MiB, and ``_C_stable_libtorch.abi3.so`` alone is
about 59 MB as ``xz -9e``, so each library travels in its own call to one
warm machine (which keeps /tmp between calls); the suite's call then finds
them where ``vllm_pyshim.py`` looks (``/tmp/vllm_kernels/<version>``).

Here (CPU side, stdlib only):
    python tests/gpu/stage_kernels.py pack --vllm 0.34.0 [--flash-attn]
extracts the libraries from ``.cache/wheels/cuda-<version>/vllm-*.whl`` into
``.cache/vllm-kernels/<version>/vllm/`` (git-ignored), compresses each with
``nice -n 19 xz -9e`` (once) and prints the device calls.
There (device side, torch present):
    python3 tests/gpu/stage_kernels.py unpack
unpacks every carried ``.cache/vllm-kernels/<version>/vllm/**.so.xz`` into
``/tmp/vllm_kernels/<version>/`` (same layout as ``vllm/``);
    python3 tests/gpu/stage_kernels.py check --vllm 0.34.0
loads them through the shim (as an engine would), prints which ops are vLLM's
kernels and which stand-ins, and compares the kernels with the stand-ins on
random inputs.
"""

from __future__ import annotations

import argparse
import glob
import lzma
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
CACHE = ROOT / ".cache" / "vllm-kernels"
DEVICE_DIR = Path("/tmp/vllm_kernels")
STABLE = ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so")
FLASH_ATTN = ("vllm_flash_attn/_vllm_fa3_C.abi3.so",)
CARRY_LIMIT = 64 << 20


def _wheel(version: str) -> Path:
    found = sorted((ROOT / ".cache" / "wheels" / f"cuda-{version}").glob("vllm-*.whl"))
    if not found:
        sys.exit(
            f"no CUDA wheel of vllm {version} in .cache/wheels/cuda-{version}: "
            f".venv/bin/python tools/fork.py check --base cuda --vllm {version}"
        )
    return found[-1]


def pack(version: str, flash_attn: bool) -> None:
    wheel = _wheel(version)
    dest = CACHE / version / "vllm"
    with zipfile.ZipFile(wheel) as zf:
        libs = {i.filename: i.file_size for i in zf.infolist()}
        print(f"{wheel.name}: compiled libraries")
        for name, size in sorted(libs.items()):
            if name.endswith(".so"):
                print(f"  {name} {size / 1e6:.1f} MB")
        wanted = STABLE + (FLASH_ATTN if flash_attn else ())
        carries = []
        for rel in wanted:
            if f"vllm/{rel}" not in libs:
                print(f"  (no vllm/{rel} in this wheel)")
                continue
            so = dest / rel
            xz = so.with_name(so.name + ".xz")
            if not xz.exists() or xz.stat().st_mtime < wheel.stat().st_mtime:
                so.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(f"vllm/{rel}") as src, open(so, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 24)
                part = xz.with_name(xz.name + ".part")
                with open(part, "wb") as out:
                    subprocess.run(
                        ["nice", "-n", "19", "xz", "-T1", "-9e", "-c", str(so)],
                        stdout=out,
                        check=True,
                    )
                part.rename(xz)
            carries.append(xz.relative_to(ROOT))
    print("device calls, one per library, to one warm machine:")
    for path in carries:
        size = (ROOT / path).stat().st_size
        note = "" if size < CARRY_LIMIT - (8 << 20) else "  (near the 64 MiB carry)"
        print(
            f'  run(command="python3 tests/gpu/stage_kernels.py unpack", '
            f'carry=["{path}"])  # {size / 1e6:.1f} MB{note}'
        )
    print(f"  then: python3 tests/gpu/stage_kernels.py check --vllm {version}")


def unpack() -> None:
    for xz in sorted(
        glob.glob(str(CACHE / "*" / "vllm" / "**" / "*.so.xz"), recursive=True)
    ):
        rel = Path(xz).relative_to(CACHE)
        version, inner = rel.parts[0], Path(*rel.parts[2:])
        out = DEVICE_DIR / version / inner.with_suffix("")
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_name(out.name + ".part")
        with lzma.open(xz) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
        part.rename(out)
        print(f"unpacked {out} ({out.stat().st_size / 1e6:.1f} MB)", flush=True)
    for path in sorted(DEVICE_DIR.glob("*/**/*.so")):
        print(f"staged: {path} ({path.stat().st_size / 1e6:.1f} MB)")


def check(version: str) -> None:
    os.environ["VLLM_PYSHIM_KERNELS"] = str(DEVICE_DIR / version)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    import vllm_pyshim as shim

    print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
    shim.install()
    for rel in FLASH_ATTN:
        try:
            shim.import_flash_attn(Path(rel).name.split(".")[0], required=True)
            ns = Path(rel).name.split(".")[0]
            n = sum(
                str(s).startswith(ns + "::") for s in torch._C._jit_get_all_schemas()
            )
            print(f"{rel}: {n} ops in {ns}")
        except ImportError as e:
            print(f"{rel}: {e}")
    report = shim.report()
    for ns in ("_C", "_moe_C", "_C_cache_ops", "_C_cuda_utils"):
        n = sum(str(s).startswith(ns + "::") for s in torch._C._jit_get_all_schemas())
        print(f"{ns}: {n} ops registered")
    print("libraries:", report["libraries"])
    print("vLLM kernels:", report["kernel_ops"])
    print("stand-ins:", report["stand_ins"])
    _compare(torch, shim)


def _diff(a, b) -> str:
    return f"{(a.float() - b.float()).abs().max().item():.3e}"


def _compare(torch, shim) -> None:
    """Each kernel against its stand-in on random inputs (the stand-ins are
    what every earlier GPU figure ran on)."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    kernels = set(shim.KERNEL_OPS)

    if "_moe_C.topk_softmax" in kernels:
        for dtype in (torch.float32, torch.bfloat16):
            t, e, k = 4096, 128, 8
            logits = torch.randn(t, e, device=dev, generator=g).to(dtype)

            def topk(op, logits=logits, t=t, k=k):
                w = torch.empty(t, k, device=dev)
                ids = torch.empty(t, k, device=dev, dtype=torch.int32)
                tei = torch.empty(t, k, device=dev, dtype=torch.int32)
                op(w, ids, tei, logits, False, None, None)
                return w, ids

            kw, kid = topk(torch.ops._moe_C.topk_softmax)
            sw, sid = topk(shim.topk_softmax)
            print(
                f"compare _moe_C.topk_softmax {dtype}: ids equal "
                f"{bool((kid == sid).all())} ({int((kid != sid).sum())} of "
                f"{kid.numel()} differ), max |w| diff {_diff(kw, sw)}",
                flush=True,
            )
    if "_C.rms_norm" in kernels:
        x = torch.randn(256, 2048, device=dev, generator=g, dtype=torch.bfloat16)
        w = torch.randn(2048, device=dev, generator=g, dtype=torch.bfloat16)
        a, b = torch.empty_like(x), torch.empty_like(x)
        torch.ops._C.rms_norm(a, x, w, 1e-6)
        shim.rms_norm(b, x, w, 1e-6)
        print(f"compare _C.rms_norm bf16: max diff {_diff(a, b)}")
    if "_C.silu_and_mul" in kernels:
        x = torch.randn(256, 4096, device=dev, generator=g, dtype=torch.bfloat16)
        a = torch.empty(256, 2048, device=dev, dtype=torch.bfloat16)
        b = torch.empty_like(a)
        torch.ops._C.silu_and_mul(a, x)
        shim.silu_and_mul(b, x)
        print(f"compare _C.silu_and_mul bf16: max diff {_diff(a, b)}")
    if "_moe_C.moe_align_block_size" in kernels:
        t, e, k, bs = 333, 16, 4, 16
        ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)]).int()
        max_pad = ids.numel() + e * (bs - 1)
        outs = []
        for fn in (torch.ops._moe_C.moe_align_block_size, shim.moe_align_block_size):
            s = torch.empty(max_pad, dtype=torch.int32, device=dev)
            ex = torch.empty((max_pad + bs - 1) // bs, dtype=torch.int32, device=dev)
            n = torch.empty(1, dtype=torch.int32, device=dev)
            fn(ids, e, bs, s, ex, n, None, None)
            total = int(n.item())
            # Tokens within an expert's segment come in any order (the
            # kernel's atomics): compare each expert's set of tokens.
            per_expert: dict[int, list[int]] = {}
            for b, expert in enumerate(ex[: total // bs].tolist()):
                block = [
                    t for t in s[b * bs : (b + 1) * bs].tolist() if t < ids.numel()
                ]
                per_expert.setdefault(expert, []).extend(block)
            segs = sorted((e, sorted(toks)) for e, toks in per_expert.items())
            outs.append((total, segs))
        print(
            "compare _moe_C.moe_align_block_size: total and tokens per expert equal",
            outs[0] == outs[1],
            f"(totals {outs[0][0]}, {outs[1][0]})",
        )
    if "_moe_C.moe_sum" in kernels:
        x = torch.randn(64, 4, 512, device=dev, generator=g)
        a, b = torch.empty(64, 512, device=dev), torch.empty(64, 512, device=dev)
        torch.ops._moe_C.moe_sum(x, a)
        shim.moe_sum(x, b)
        print(f"compare _moe_C.moe_sum f32: max diff {_diff(a, b)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--vllm", required=True)
    p.add_argument("--flash-attn", action="store_true")
    sub.add_parser("unpack")
    c = sub.add_parser("check")
    c.add_argument("--vllm", required=True)
    args = parser.parse_args()
    if args.cmd == "pack":
        pack(args.vllm, args.flash_attn)
    elif args.cmd == "unpack":
        unpack()
    else:
        check(args.vllm)


if __name__ == "__main__":
    main()
