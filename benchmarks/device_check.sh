#!/usr/bin/env bash
# The device check: on a machine with a CUDA GPU, run the GPU tests (pytest -m gpu) and the
# short GPU benchmark, and print ONE table (Markdown, ready for the README). Bounded: the
# tests get DEVICE_CHECK_TEST_S seconds (default 300), the benchmark DEVICE_CHECK_BENCH_S
# (default 210): at most 9 minutes in all. Without a GPU it stops at once with a message.
# The table judges the spatial conv step against the device's own limit (cuDNN on each rank's
# piece with no halo, all ranks at once), per halo transport, and hpcpar's NCCL DDP step
# against torch's DDP(NCCL); benchmarks/device_check.py says each row.
#
#   benchmarks/device_check.sh                 # from the repository root, or anywhere
#   DEVICE_CHECK_RANKS=2 DEVICE_CHECK_ARGS="--size 64" benchmarks/device_check.sh
#
# Exit status: 0 all passed, 1 a test or the benchmark failed or timed out, 2 no GPU here.
# Logs: $DEVICE_CHECK_LOGS (default: a temporary folder), named in the output.
set -u
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python}
RANKS=${DEVICE_CHECK_RANKS:-2}
TEST_S=${DEVICE_CHECK_TEST_S:-300}
BENCH_S=${DEVICE_CHECK_BENCH_S:-210}
LOGS=${DEVICE_CHECK_LOGS:-$(mktemp -d -t hpcpar-device-check.XXXXXX)}
mkdir -p "$LOGS"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HPCPAR_TEST_MAX_NP=${HPCPAR_TEST_MAX_NP:-$RANKS}

# 1. fail fast without a GPU (30 s cap: a broken driver must not hang the check)
if ! why=$(timeout 30 "$PY" - <<'PYEOF' 2>&1
import sys
from hpcpar.testing.gpu import gpu_skip_reason
reason = gpu_skip_reason()
if reason:
    print(reason)
    sys.exit(1)
import torch
print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}")
PYEOF
); then
    echo "device_check: no GPU to check here: ${why##*$'\n'}" >&2
    echo "device_check: run it on a machine with a CUDA device (nothing was measured)" >&2
    exit 2
fi
echo "device_check: $why; logs in $LOGS"

# 2. the GPU tests
status=0
timeout -k 10 "$TEST_S" "$PY" -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider \
    >"$LOGS/pytest.log" 2>&1
rc=$?
summary=$(grep -E "^=*.*(passed|failed|skipped|error)" "$LOGS/pytest.log" | tail -1 | tr -d '=')
summary=${summary:-"no summary (exit $rc)"}
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    summary="TIMED OUT after ${TEST_S} s: $summary"
fi
[ "$rc" -ne 0 ] && status=1

# 3. the benchmark, printing the one table (the test summary is its first row)
MPIEXEC=${HPCPAR_MPIEXEC:-$("$PY" -c "from hpcpar.launch.mpiexec import find_mpiexec; print(find_mpiexec())")}
# shellcheck disable=SC2086
timeout -k 10 "$BENCH_S" $MPIEXEC -n "$RANKS" "$PY" benchmarks/device_check.py \
    --tests "${summary# }" ${DEVICE_CHECK_ARGS:-} >"$LOGS/bench.out" 2>"$LOGS/bench.log"
brc=$?
if [ "$brc" -eq 0 ]; then
    cat "$LOGS/bench.out"
else
    echo "| what | measured |"
    echo "|---|---|"
    echo "| pytest -m gpu (tests/gpu) | ${summary# } |"
    echo "| benchmark | FAILED (exit $brc$([ "$brc" -eq 124 ] && echo ", timed out after ${BENCH_S} s")): see $LOGS/bench.log |"
    status=1
fi
if [ "$status" -ne 0 ]; then
    echo "device_check: FAILED; failures and skips: $LOGS/pytest.log" >&2
    grep -E "^(FAILED|ERROR|SKIPPED)" "$LOGS/pytest.log" | head -20 >&2
fi
exit "$status"
