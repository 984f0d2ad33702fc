#!/bin/bash
# The project's copy of ../shared/tools/gpu/pack_vllm_carry.sh: it packs
# tests/gpu/vllm_pyshim.py (the capturable stand-ins) beside the tree.
# tests/gpu/make_carry.sh calls it for the fork's and the pristine tree.
#
# Pack a vLLM *Python* tree (no compiled extensions) + the wheels that
# `import vllm` / the offline LLM path need into a carry folder for the device
# machine (torch 2.11 there, so vLLM's own .so files can't be used).
#
# usage: pack_vllm_carry.sh SRC_VLLM_DIR DIST_INFO_SRC DEST_CARRY_DIR [WHEEL_DIR]
#   SRC_VLLM_DIR   a vllm/ package dir (fork checkout's vllm/, or an unpacked wheel)
#   DIST_INFO_SRC  a vllm wheel (.whl) to take vllm-X.dist-info from (platform
#                  detection calls importlib.metadata.version("vllm")), or a
#                  ready *.dist-info dir
#   DEST_CARRY_DIR e.g. .devcarry in your checkout (must be git-ignored; carry it)
#   WHEEL_DIR      cp312 manylinux wheels to carry (default: skip)
# EXTRA_PKGS (environment, optional): package directories to carry beside
#   vllm/ at the top of the tree, e.g. the fork's vllm_host_transport (the
#   artifact store imports it); tests/gpu/make_carry.sh sets it.
# Adds to the packed copy only: vllm/_C_stable_libtorch.py,
# vllm/_moe_C_stable_libtorch.py (-> vllm_pyshim.install(): vLLM's own
# stable-ABI libraries where tests/gpu/stage_kernels.py staged them on the
# device, stand-ins for the ops still missing),
# vllm/vllm_flash_attn/_vllm_fa{2,3}_C.py (-> vllm_pyshim.import_flash_attn),
# and vllm_pyshim.py.
set -euo pipefail
SRC=$1; DIST=$2; DEST=$3; WHL=${4:-}
HERE=$(cd "$(dirname "$0")" && pwd)
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/site"
cp -a "$SRC" "$STAGE/site/vllm"
for pkg in ${EXTRA_PKGS:-}; do
  cp -a "$pkg" "$STAGE/site/$(basename "$pkg")"
  chmod -R u+w "$STAGE/site/$(basename "$pkg")"
  find "$STAGE/site/$(basename "$pkg")" -name __pycache__ -prune -exec rm -rf {} +
done
chmod -R u+w "$STAGE/site/vllm"
cd "$STAGE/site"
# drop compiled artefacts and big non-Python payloads
find vllm -name '*.so' -delete
find vllm -name __pycache__ -prune -exec rm -rf {} +
rm -f vllm/vllm-rs
for d in vllm/third_party/deep_gemm vllm/third_party/fmha_sm100; do
  [ -d "$d" ] && find "$d" -type f ! -name '*.py' -delete
done
find vllm -type d -empty -delete
# stubs
for m in _C_stable_libtorch _moe_C_stable_libtorch; do
  printf '# pyshim stub (no compiled extension in this tree)\nimport vllm_pyshim\n\nvllm_pyshim.install()\n' > vllm/$m.py
done
# FlashAttention: the staged library when there is one (stage_kernels.py);
# else FA2 stays an empty module (vllm.vllm_flash_attn imports) and FA3 an
# ImportError (vLLM reports it unavailable), as before.
for m in _vllm_fa2_C:False _vllm_fa3_C:True; do
  printf '# pyshim stub: vLLM'"'"'s library if staged\nimport vllm_pyshim\n\nvllm_pyshim.import_flash_attn("%s", required=%s)\n' \
    "${m%%:*}" "${m##*:}" > "vllm/vllm_flash_attn/${m%%:*}.py"
done
cp "$HERE/vllm_pyshim.py" .
if [ -d "$DIST" ]; then
  cp -a "$DIST" .
else
  unzip -q -o "$DIST" '*.dist-info/*' -x '*/RECORD'
fi
mkdir -p "$DEST"
tar czf "$DEST/vllm_site.tgz" .
if [ -n "$WHL" ]; then
  mkdir -p "$DEST/whl"
  cp "$WHL"/*.whl "$DEST/whl/"
fi
du -sh "$DEST"/* 
