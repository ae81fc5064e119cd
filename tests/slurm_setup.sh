#!/usr/bin/env bash
# Debian packages for the single-host Slurm test (tests/slurm_cluster.py); a no-op when they are there,
# so CI pays for apt only on a fresh machine. The test starts and stops the daemons itself.
set -euo pipefail
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi
