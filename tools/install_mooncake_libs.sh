#!/usr/bin/env bash
# The Debian libraries Mooncake's native modules link and a slim image lacks
# (libibverbs1 librdmacm1 liburing2; needed even for TCP). Run by `make
# setup`: installs them with apt-get when they are missing and this runs as
# root; otherwise says what to install and leaves the Mooncake tests to skip.
set -uo pipefail
missing=()
for lib in libibverbs.so.1 librdmacm.so.1 liburing.so.2; do
  ldconfig -p 2>/dev/null | grep -q "$lib" || missing+=("$lib")
done
[ ${#missing[@]} -eq 0 ] && exit 0
pkgs="libibverbs1 librdmacm1 liburing2"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] installing $pkgs for Mooncake (missing: ${missing[*]})"
  if DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 &&
     DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $pkgs >/dev/null 2>&1; then
    exit 0
  fi
  echo "[setup] WARNING: apt-get could not install $pkgs; the Mooncake tests will be skipped" >&2
  exit 0
fi
echo "[setup] WARNING: Mooncake needs $pkgs (missing: ${missing[*]}); install them" \
  "(e.g. sudo apt-get install -y $pkgs), or the Mooncake tests are skipped" >&2
exit 0
