#!/usr/bin/env bash
# Installs the system services the tests start themselves (Prometheus and Redis from Debian).
# The tests start and stop each server on 127.0.0.1; this script only makes the binaries present.
set -euo pipefail
if ! command -v prometheus >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
      || echo "warning: could not install prometheus; its end-to-end test will be skipped" >&2
    # The tests run their own Prometheus on a free loopback port; a packaged service, if the
    # package started one, is left alone.
  fi
fi
# Redis holds the GCS state of the multi-node cluster tests' head (GCS fault tolerance).
if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server >/dev/null) \
      || echo "warning: could not install redis-server; the head fault-tolerance test will be skipped" >&2
  fi
fi
