#!/usr/bin/env bash
# Debian packages for the real-Slurm tests (hpcpar.testing.slurm starts a private
# single-node cluster from them, hpcpar.testing.cluster a multi-node one in network
# namespaces): slurmctld, slurmd, the client commands, munge, ip/tc and nsenter/unshare.
# The packages' own services are not used (and not started here). Without apt-get the
# commands must be there already, else this fails.
set -euo pipefail
if command -v apt-get >/dev/null; then
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge iproute2 util-linux >/dev/null
else
    .ci/require "slurmctld slurmd slurm-client munge iproute2 util-linux" \
        slurmctld slurmd sbatch munged ip tc nsenter unshare
fi
