#!/usr/bin/env bash
# The benchmarks' smoke test (a stage of .ci/run): every benchmark once at its smallest size,
# so none rots unnoticed. Each must exit 0 within its time, print no traceback and print its
# ratio line (the pattern beside it); the timings mean nothing at these sizes. From the
# repository root:  benchmarks/smoke.sh [NAME...]   (default: all)
#
# Not here: limits.py (a module the others import), device_check.py (needs a CUDA GPU; run
# by device_check.sh on one) and distdl_peer.py (needs DistDL built from its git checkout).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python}
MPIEXEC=${MPIEXEC:-mpiexec}
export OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOGS=${SMOKE_LOGS:-$(mktemp -d -t hpcpar-smoke.XXXXXX)}
mkdir -p "$LOGS"
rm -f "$LOGS"/*.verdict
start=$SECONDS
# Two at a time (CI's machine has 2 cores; most smokes are one process or two ranks, and
# their timings mean nothing): each writes its verdict to LOGS/NAME.verdict, read at the end.
JOBS=${SMOKE_JOBS:-2}

smoke() {   # smoke NAME SECONDS RATIO-PATTERN CMD...
    local name=$1
    if [ -n "$only" ] && [[ " $only " != *" $name "* ]]; then return; fi
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
    run_one "$@" &
}

smoke_alone() {   # as smoke, with nothing beside it: a virtual cluster, or data another uses
    local name=$1
    if [ -n "$only" ] && [[ " $only " != *" $name "* ]]; then return; fi
    wait
    run_one "$@"
}

run_one() {   # one smoke; prints its line, leaves LOGS/NAME.verdict = ok or failed
    local name=$1 limit=$2 ratio=$3 t0=$SECONDS rc
    shift 3
    timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && grep -q "Traceback" "$LOGS/$name.log"; then
        rc="a traceback"
    elif [ $rc -eq 0 ] && ! grep -Eq "$ratio" "$LOGS/$name.log"; then
        rc="no line matching '$ratio'"
    fi
    if [ "$rc" = 0 ]; then
        echo "== $name: ok in $((SECONDS - t0)) s: $(grep -Em1 "$ratio" "$LOGS/$name.log")"
        echo ok > "$LOGS/$name.verdict"
    else
        [ "$rc" = 124 ] && rc="timed out after $limit s"
        echo "== $name: FAILED ($rc) in $((SECONDS - t0)) s: $*" | tee "$LOGS/$name.verdict"
    fi
}

only="$*"
N='[0-9]+\.?[0-9]*'
smoke allreduce 120 "gloo/hpcpar = $N" \
    "$MPIEXEC" -n 2 "$PY" benchmarks/allreduce.py --mb 1 --cnn 16 --rounds 1 --steps 2 --warmup 1
smoke boundary_sample 240 "halo bytes per step: ${N}x lower" \
    "$PY" benchmarks/boundary_sample.py --job jobs/demo-gcn-cora.toml -n 2 --seeds 0 \
    --set train.epochs=5 --runs "$LOGS/bns"
smoke checkpoint_cost 240 "^async every step +$N" \
    "$PY" benchmarks/checkpoint_cost.py -n 1 --rounds 1 --steps 7
smoke checkpointing 300 "peak cut ${N}x" \
    "$PY" benchmarks/checkpointing.py --size 48 --depth 1 --channels 1 --repeat 1
smoke conv1x1 120 "/ hpcpar's \\([^)]*\\): ${N}x" \
    "$PY" benchmarks/conv1x1.py --size 12 --rounds 1
smoke fused_halos 120 "best fused speedup $N" \
    "$MPIEXEC" -n 2 "$PY" benchmarks/fused_halos.py --local 8 --channels 4 --layers 2 \
    --grids 2x1x1 --fuse 2 --rounds 1 --repeat 1
smoke fp16_loss 300 "relative difference ${N}%" \
    "$MPIEXEC" -n 4 "$PY" benchmarks/fp16_loss.py --steps 7
smoke gnn 120 "ratio hpcpar/PyG $N" \
    "$MPIEXEC" -n 2 "$PY" benchmarks/gnn.py --nodes 2000 --features 16 --epochs 2
# gnn_scale.py takes a synthetic graph job: the 1M-vertex one shrunk to 5000 vertices
sed -e "s|^path = .*|path = \"$LOGS/graph-5k.h5\"|" -e 's/^nodes = .*/nodes = 5000/' \
    -e 's/^communities = .*/communities = 16/' jobs/gcn-synthetic.toml > "$LOGS/gcn-5k.toml"
smoke gnn_scale 240 "^ +2 +$N" \
    "$PY" benchmarks/gnn_scale.py --job "$LOGS/gcn-5k.toml" --ranks 1,2 --epochs 2 --rounds 1
smoke io 120 "in-memory $N ms = ${N}x" \
    "$MPIEXEC" -n 2 "$PY" benchmarks/io.py --grid 1x2x1x1 --size 16 --samples 4 --repeats 1
smoke job_ab 240 "^demo-cosmoflow.toml +b +$N .* ${N}x$" \
    "$PY" benchmarks/job_ab.py --a train.channels_last=false --b train.channels_last=true \
    --jobs jobs/demo-cosmoflow.toml --rounds 1 --steps 7
smoke largest_sample 300 "^\| hpcpar \| 1 \| .* \| [0-9]+ \| $N \|" \
    "$PY" benchmarks/largest_sample.py --ranks 1 --levers none --limit 640MiB --step 16 --max-edge 48 \
    --work "$LOGS/largest"
smoke memory 120 "$N +$N +(yes|no)$" \
    "$MPIEXEC" -n 2 "$PY" benchmarks/memory.py --size 16 --layers 1
smoke_alone multinode 300 "^ +1\.0 +$N +$N +$N +$N" \
    "$PY" benchmarks/multinode.py --nodes 2 --per-node 2 --mb 1 --rounds 1 --reps 1
smoke_alone plan 300 "configurations within" \
    "$PY" benchmarks/plan.py --jobs jobs/demo-cosmoflow.toml --ranks 1 --steps 7 --repeat 1
smoke_alone plan_cluster 600 "within \+-25%" \
    "$PY" benchmarks/plan_cluster.py --nodes 2 --per-node 2 --steps 7 \
    --machine slurm/machines/local.toml   # calibrating on the cluster: test_multinode.py
smoke predict 300 "ratio hpcpar / monai wall time: $N" \
    "$PY" benchmarks/predict.py --size 16 --roi 8 --train-steps 1 --reps 1 \
    --work "$LOGS/predict"
smoke spatial 120 "^ +hpcpar 2x1x1 +2 +$N +$N" \
    "$MPIEXEC" -n 2 "$PY" benchmarks/spatial.py --size 16 --channels 4 --layers 1 --repeat 1 \
    --rounds 1 --grids 1x1x1,2x1x1
smoke spatialize_cost 120 "spatialized / plain step: ${N}x" \
    "$PY" benchmarks/spatialize_cost.py --layers 10 --size 8 --rounds 1
smoke third_party_models 240 "configurations on" \
    "$MPIEXEC" -n 2 "$PY" benchmarks/third_party_models.py --grids 1x2x1x1 --only m_unet,m_segresnet

wait
failed=()
for verdict in "$LOGS"/*.verdict; do
    [ -e "$verdict" ] || continue
    [ "$(cat "$verdict")" = ok ] && continue
    failed+=("$(basename "$verdict" .verdict)")
    cat "$verdict"
    tail -n 25 "${verdict%.verdict}.log"
done
echo "== smoke: $(( SECONDS - start )) s in all; logs in $LOGS"
if [ ${#failed[@]} -gt 0 ]; then
    echo "== smoke: FAILED: ${failed[*]}" >&2
    exit 1
fi
