#!/usr/bin/env bash
# Debian's libibverbs1 for Mooncake's transfer engine (prefill/decode disaggregation's KV transfer): its
# library links against libibverbs even when only the TCP transport runs. A no-op when it is there.
set -euo pipefail
if ldconfig -p | grep -q 'libibverbs\.so\.1 '; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
