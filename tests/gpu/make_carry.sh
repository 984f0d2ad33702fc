#!/bin/bash
# Build .devcarry/ (git-ignored) for the GPU harness from this checkout:
#   [VLLM=0.34.0] bash tests/gpu/make_carry.sh    (default: VLLM=0.32.0)
# - vllm_site.tgz: the fork's tree on the CUDA base (tools/fork.py
#   materialize --base cuda: vllm/ and the fork's top-level packages beside
#   it, vllm_host_transport) with tests/gpu/vllm_pyshim.py;
# - base_site.tgz: the pristine vllm CUDA wheel's tree of that release, the
#   same way;
# - whl/: the cp312 wheels the device lacks (../shared/tools/gpu/
#   fetch_wheels.sh, fetched once into .devcarry-wheels/);
# - models/tiny-moe: the tiny real-weight MoE of tests/gpu;
# - run.sh, probe.py: the shared harness's driver (unchanged).
# Then, one device call:
#   CMD="bash tests/gpu/device_run.sh" SKIP_ENV=1 TCMD=540 bash .devcarry/run.sh
#
# KERNELS=1 also stages vLLM's own kernels (issue 39): the wheel's stable-ABI
# libraries, compressed into .cache/vllm-kernels/<version>/ (git-ignored) by
# tests/gpu/stage_kernels.py, which prints one device call per library
# (KERNELS=fa adds FlashAttention 3); those calls go first, to the same warm
# machine, and the shim loads what they staged (/tmp/vllm_kernels/<version>).
#
# The shared harness's tools (shared/tools/gpu: run.sh, probe.py,
# fetch_wheels.sh) are looked up in $SHARED_DIR/tools/gpu when SHARED_DIR
# names the shared/ directory, else in shared/tools/gpu of this checkout or of
# any directory above it (../shared beside the main checkout, and a clone
# anywhere below that directory). `make_carry.sh --shared-tools` prints the
# directory it would use and stops.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
TOOLS="run.sh probe.py fetch_wheels.sh"

has_tools() {
  local t
  for t in $TOOLS; do [ -f "$1/$t" ] || return 1; done
}

find_shared_tools() {
  if [ -n "${SHARED_DIR:-}" ]; then
    if has_tools "$SHARED_DIR/tools/gpu"; then
      (cd "$SHARED_DIR/tools/gpu" && pwd)
      return
    fi
    echo "make_carry.sh: SHARED_DIR=$SHARED_DIR has no tools/gpu/ with $TOOLS;" \
      "set SHARED_DIR to the shared/ directory that holds them" >&2
    exit 2
  fi
  local dir=$ROOT
  while :; do
    if has_tools "$dir/shared/tools/gpu"; then
      (cd "$dir/shared/tools/gpu" && pwd)
      return
    fi
    [ "$dir" = / ] && break
    dir=$(dirname "$dir")
  done
  echo "make_carry.sh: the shared GPU tools ($TOOLS) are not in shared/tools/gpu" \
    "of $ROOT or of any directory above it; set SHARED_DIR=/path/to/shared" \
    "(the directory holding tools/gpu/)" >&2
  exit 2
}

SHARED=$(find_shared_tools)
if [ "${1:-}" = --shared-tools ]; then
  echo "$SHARED"
  exit 0
fi
VLLM=${VLLM:-0.32.0}
.venv/bin/python tools/fork.py check --base cuda --vllm "$VLLM" >/dev/null
WHEEL=$(ls "$ROOT"/.cache/wheels/cuda-"$VLLM"/vllm-"$VLLM"-*.whl)
STAGE=$(mktemp -d "$ROOT/.cache/carry.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
[ -d .devcarry-wheels ] || bash "$SHARED/fetch_wheels.sh" .devcarry-wheels
# vLLM 0.34.0's serving modules import orjson (0.32.0's do not).
ls .devcarry-wheels/orjson-* >/dev/null 2>&1 || .venv/bin/python -m pip download -q \
  --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 -d .devcarry-wheels orjson==3.13.0
mkdir -p .devcarry
.venv/bin/python tools/fork.py materialize --base cuda --vllm "$VLLM" "$STAGE/fork"
# Every top-level package materialize wrote beside vllm/ travels with it.
EXTRA_PKGS=""
for d in "$STAGE"/fork/*/; do
  d=${d%/}
  case $(basename "$d") in vllm|*.dist-info) ;; *) EXTRA_PKGS="$EXTRA_PKGS $d" ;; esac
done
EXTRA_PKGS=$EXTRA_PKGS bash tests/gpu/pack_vllm_carry.sh "$STAGE/fork/vllm" "$WHEEL" \
  "$ROOT/.devcarry" "$ROOT/.devcarry-wheels"
mkdir -p "$STAGE/base"
(cd "$STAGE/base" && unzip -q "$WHEEL" 'vllm/*')
bash tests/gpu/pack_vllm_carry.sh "$STAGE/base/vllm" "$WHEEL" "$STAGE/base_carry"
mv "$STAGE/base_carry/vllm_site.tgz" .devcarry/base_site.tgz
[ -d .devcarry/models/tiny-moe ] || .venv/bin/python tools/build_tiny_moe.py \
  --out .devcarry/models/tiny-moe --layers 3 --experts 16 --top-k 4
install -m 0755 "$SHARED/run.sh" .devcarry/run.sh
install -m 0644 "$SHARED/probe.py" .devcarry/probe.py
case ${KERNELS:-0} in
  0) ;;
  fa) .venv/bin/python tests/gpu/stage_kernels.py pack --vllm "$VLLM" --flash-attn ;;
  *) .venv/bin/python tests/gpu/stage_kernels.py pack --vllm "$VLLM" ;;
esac
du -sh .devcarry
