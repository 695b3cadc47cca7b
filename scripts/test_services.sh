#!/usr/bin/env bash
# Installs the system services the tests start themselves (Prometheus from Debian).
# The tests start and stop each server on 127.0.0.1; this script only makes the binaries present.
set -euo pipefail
if ! command -v prometheus >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
      || echo "warning: could not install prometheus; its end-to-end test will be skipped" >&2
    # The Debian package starts a system service; the tests run their own on loopback.
    (command -v systemctl >/dev/null && systemctl stop prometheus 2>/dev/null) || true
    pkill -x prometheus 2>/dev/null || true
  fi
fi
