#!/usr/bin/env bash
# Debian packages for the single-host Slurm tests (tests/slurm_cluster.py); a no-op when they are there,
# so CI pays for apt only on a fresh machine. The tests start and stop the daemons themselves.
set -euo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  # Not fatal: the Slurm tests then skip and say why.
  echo "slurm_setup: no apt-get; the Slurm tests will be skipped" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
