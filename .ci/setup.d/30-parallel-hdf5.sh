#!/usr/bin/env bash
# Parallel HDF5 for the reader's mpio path (tests/data/test_mpio.py): Debian's HDF5 built
# against MPICH, and its own virtual environment (/opt/hpcpar-mpio-venv, or MPIO_VENV) whose
# mpi4py and h5py are built from source against that MPICH and that HDF5. It sees the main
# interpreter's packages (--system-site-packages: numpy, torch, hpcpar, installed by .ci/run
# later); its own mpi4py and h5py shadow the main ones. Quick when already done; a build
# takes about 6 minutes on 2 cores.
# ci: background
set -euo pipefail
venv="${MPIO_VENV:-/opt/hpcpar-mpio-venv}"
python="${PYTHON:-python}"  # the interpreter .ci/run installs into
if command -v apt-get >/dev/null; then
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
        libhdf5-mpich-dev mpich pkg-config >/dev/null
else
    .ci/require "libhdf5-mpich-dev mpich pkg-config" mpicc.mpich mpiexec.mpich pkg-config
    pkg-config --exists hdf5-mpich || { echo "no apt-get, and no hdf5-mpich for pkg-config" \
        "(libhdf5-mpich-dev)" >&2; exit 1; }
fi
ready() {
    "$venv/bin/python" - <<'PY' 2>/dev/null
import h5py, mpi4py.MPI as MPI
assert h5py.get_config().mpi and "MPICH" in MPI.Get_library_version()
PY
}
if [ -x "$venv/bin/python" ] && ready; then
    echo "$venv: parallel h5py already built"
    exit 0
fi
start=$SECONDS
"$python" -m venv --clear --system-site-packages "$venv"
pip=("$venv/bin/pip" install -q --no-cache-dir)
# h5py's build needs these, in this environment (the main one may be installing meanwhile:
# CI runs this script beside its pip installs).
"${pip[@]}" --ignore-installed numpy "cython>=3" pkgconfig "setuptools>=77"
export CC=mpicc.mpich MPICC=mpicc.mpich HDF5_MPI=ON HDF5_PKGCONFIG_NAME=hdf5-mpich
# Python's default -O3 -g makes mpi4py's one big C file a 5-minute compile: -O1, no debug info.
export CFLAGS="-O1 -g0"
# --ignore-installed: our own builds even where the main environment has wheels of them; one
# mpi4py build, which h5py's build then uses (no build isolation, that would build another).
"${pip[@]}" --ignore-installed --no-deps --no-binary=mpi4py mpi4py
"${pip[@]}" --ignore-installed --no-deps --no-binary=h5py --no-build-isolation h5py
ready || { echo "$venv: h5py or mpi4py not built against MPICH" >&2; exit 1; }
echo "$venv: parallel h5py built in $((SECONDS - start)) s"
