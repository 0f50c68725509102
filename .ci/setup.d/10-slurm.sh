#!/usr/bin/env bash
# Debian packages for the real-Slurm tests (tests/slurm_cluster.py starts a private
# single-node cluster from them): slurmctld, slurmd, the client commands and munge.
# The packages' own services are not used (and not started here).
set -euo pipefail
if command -v apt-get >/dev/null; then
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
fi
