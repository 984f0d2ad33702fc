#!/bin/bash
# Device-side driver for tests/gpu (and, with BENCH set, benchmarks/bench_r3_gpu.py).
# Run through the GPU harness from the repository root:
#   CMD="bash tests/gpu/device_run.sh" SKIP_ENV=1 TCMD=540 bash .devcarry/run.sh
# Expects the fork's tree in /tmp/site (run.sh unpacks .devcarry/vllm_site.tgz)
# and unpacks the pristine tree (.devcarry/base_site.tgz) into /tmp/site_base.
# vLLM's own kernels: stage them first (tests/gpu/stage_kernels.py); on a warm
# machine that ran another release, start the command with rm -rf /tmp/site.
#   R3_TESTS=0        skip the tests
#   BENCH="off fork"  settings for the benchmark (unset: no benchmark)
#   BENCH_TAG=_b64    suffix of the benchmark's result files (several runs
#                     of this script in one call)
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/r3_out}
export OUT
T0=$(date +%s)
# A warm machine keeps /tmp between calls: a tree of another release left
# there would mix with this one's files (and its dist-info would name the
# kernels the shim loads), so the pristine tree is unpacked afresh, and a
# mixed /tmp/site (run.sh unpacks over it) stops the run.
if [ "$(ls -d /tmp/site/vllm-*.dist-info 2>/dev/null | wc -l)" -gt 1 ]; then
  echo "[device_run] /tmp/site holds two vLLM releases: rm -rf /tmp/site before run.sh" >&2
  exit 2
fi
rm -rf /tmp/site_base
mkdir -p /tmp/site_base && tar xzf .devcarry/base_site.tgz -C /tmp/site_base
echo "[device_run] base tree unpacked at $(( $(date +%s) - T0 ))s"
df -h /dev/shm | tail -1
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
python3 - <<'EOF'
import importlib.metadata as md
import platform
out = {"python": platform.python_version()}
for n in ("torch", "triton", "transformers", "numpy", "pytest", "vllm"):
    try:
        out[n] = md.version(n)
    except Exception:
        out[n] = None
print("[device_run] versions", out, flush=True)
EOF
if [ "${R3_TESTS:-1}" = 1 ]; then
  if python3 -c "import pytest" 2>/dev/null; then
    timeout "${R3_TESTS_TIMEOUT:-330}" python3 -m pytest -q -rA --confcutdir=tests/gpu \
      -p no:cacheprovider tests/gpu
  else
    timeout "${R3_TESTS_TIMEOUT:-330}" python3 tests/gpu/test_r3_gpu.py
  fi
  echo "[device_run] tests rc=$? at $(( $(date +%s) - T0 ))s"
fi
if [ -n "${BENCH:-}" ]; then
  # shellcheck disable=SC2086
  python3 benchmarks/bench_r3_gpu.py $BENCH
  echo "[device_run] bench rc=$? at $(( $(date +%s) - T0 ))s"
fi
# The harness returns only a few files: keep summaries at the top, pack the rest.
TAG=${BENCH_TAG:-}
for f in r3_gpu/comparisons.json r3_gpu/summary.json; do
  [ -f "$OUT/$f" ] && cp "$OUT/$f" "$OUT/$(echo "$f" | tr / _)"
done
[ -f "$OUT/bench_r3/result.json" ] && cp "$OUT/bench_r3/result.json" "$OUT/bench_r3_result$TAG.json"
if [ -d "$OUT/r3_gpu" ] || [ -d "$OUT/bench_r3" ]; then
  (cd "$OUT" && tar czf "results$TAG.tgz" $(ls -d r3_gpu bench_r3 2>/dev/null) && rm -rf r3_gpu bench_r3)
fi
ls -la "$OUT"
