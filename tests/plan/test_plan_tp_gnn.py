"""The planner's tensor-parallel and GNN terms, the graph partition it counts against the
one a run builds, and tensor parallelism from a job file (same training as without it)."""

from dataclasses import replace

import pytest
import torch

from hpcpar.formats.jobspec import build_job
from hpcpar.plan.gnn import GraphJob, Part
from hpcpar.plan.machine import Link, Machine, load_machine
from hpcpar.plan.planner import Layer, Workload, mark_tensor_parallel, predict, tp_linear_time
from hpcpar.testing import mpi_case, shared_tmpdir

M = Machine("test", ranks_per_node=4, flops=1e9, mem_bw=1e10, mem_per_rank=1e9, io_bw=1e9,
            intra=Link(1e-6, 1e9), inter=Link(1e-5, 1e8))


def linear(fin, fout, tp=False):
    return Layer("linear", False, (fin,), (fout,), fin * fout + fout,
                 flops=2.0 * fin * fout, tp=tp)


def test_tensor_parallel_terms():
    rows = 16
    plain = Workload("t", [linear(4096, 2048)], (4096,), global_batch=rows)
    tp = Workload("t", mark_tensor_parallel([linear(4096, 2048), linear(2048, 4)], 256),
                  (4096,), global_batch=rows)
    assert [la.tp for la in tp.layers] == [True, False]  # 4 outputs < min_features
    assert tp.tp_params == 4096 * 2048 + 2048
    assert tp.local_params(2) == tp.params - tp.tp_params + tp.tp_params // 2
    one = predict(tp, (1, 1, 1, 1), M)
    assert one.t_tp == 0 and one.t_allreduce == 0
    # GEMMs: 3 x the forward FLOPs, split over the spatial group
    gemm, comm = tp_linear_time(tp.layers[0], rows, (1, 2, 1, 1), M, M.intra)
    assert gemm == pytest.approx(3 * 2.0 * rows * 2048 * 2048 / M.flops)
    # x split: the forward all-reduces the partial output (rows x 2048) over 2 ranks, the
    # backward all-gathers the input-gradient columns (rows x 4096)
    want = 2 * (1e-6 + rows * 2048 * 4 / 2 / 1e9) + (1e-6 + rows * 4096 * 4 / 2 / 1e9)
    assert comm == pytest.approx(want)
    x2 = predict(tp, (1, 2, 1, 1), M)
    assert x2.t_tp == pytest.approx(comm)
    # the shards are complete per rank: nothing to reduce over a spatial-only grid, unlike
    # the replicated head, whose gradients the model reduces over every rank
    assert x2.t_allreduce == pytest.approx(
        predict(Workload("t", [linear(2048, 4)], (2048,), global_batch=rows),
                (1, 2, 1, 1), M).t_allreduce)
    assert predict(plain, (1, 2, 1, 1), M).t_allreduce > 10 * x2.t_allreduce
    # z split: every step all-gathers the weight block and reduce-scatters its gradient
    z2 = predict(tp, (1, 1, 1, 2), M)
    assert z2.t_tp > 2 * (4096 * 2048 * 4 / 2 / 1e9) > 50 * x2.t_tp
    # memory: 1/spatial of the head's parameters, gradients and optimizer state per rank
    assert x2.extra["memory"].params < 0.6 * predict(plain, (1, 2, 1, 1), M).extra[
        "memory"].params


def test_gemm_rates_and_graph_costs_in_machine_files(tmp_path):
    m = replace(M, gemm_rates=((4, 1e9), (64, 4e9)), graph_costs=(("spmm", 2e-9),
                                                                 ("dropout", 1e-9)))
    assert m.gemm_rate(2) == 1e9 and m.gemm_rate(1000) == 4e9
    assert m.gemm_rate(16) == pytest.approx(2.5e9)  # log-linear in the narrowest dimension
    assert m.graph_cost("spmm") == 2e-9 and replace(M).graph_cost("spmm") is None
    path = tmp_path / "m.toml"
    path.write_text(m.to_toml())
    assert load_machine(str(path)) == m
    assert replace(M).gemm_rate(16) == M.flops  # files without the new keys still load


def two_parts(ranks):
    if ranks == 1:
        return [Part(100, 400, 0, 0)]
    return [Part(50, 200, 10, 1), Part(50, 220, 12, 1)]


def test_gnn_terms():
    m = replace(M, gemm_rates=((1, 1e9),), graph_costs=(("spmm", 1e-9), ("dropout", 0.0)),
                layer_costs=(("pointwise", 0.0),))
    job = GraphJob((64, 16, 4), "gcn", 0.5, False, two_parts, 100)
    work = Workload("g", [], (64,), 1, params=job.params, graph=job)
    assert job.params == 64 * 16 + 16 + 16 * 4 + 4
    assert not predict(work, (2, 1, 1, 1), m).feasible  # a graph is one sample
    one = predict(work, (1, 1, 1, 1), m)
    assert one.t_halo == 0 and one.feasible
    # dense: layer 0 forward + weight grad (its input needs none), layer 1 three GEMMs;
    # sparse: nonzeros (edges + self loops) x the narrower width, forward + backward
    dense = (2 * 2 * 100 * 64 * 16 + 3 * 2 * 100 * 16 * 4) / 1e9
    sparse = 1e-9 * 500 * (16 + 4)
    assert one.t_compute == pytest.approx(dense + sparse)
    two = predict(work, (1, 2, 1, 1), m)
    # the slowest part (more edges and halo); halo rows x width x 4 B, forward and backward
    assert two.extra["part"] == Part(50, 220, 12, 1)
    assert two.t_halo == pytest.approx(sum(2 * (1e-6 + 12 * f * 4 / 1e9) for f in (16, 4)))
    assert two.t_compute < one.t_compute
    # 2 ranks on 1 shared core: 4 exchanges (2 layers, forward + backward) and 2 collectives
    # each wait sync_wait for the descheduled partner
    slow = replace(m, host_cores=1, sync_wait=1e-3)
    shared = predict(work, (1, 2, 1, 1), slow)
    assert shared.t_halo - two.t_halo == pytest.approx(4e-3)
    assert shared.t_allreduce_exposed - two.t_allreduce_exposed == pytest.approx(2e-3)
    # each of the 4 exchanges also pays the calibrated fixed cost of a graph halo exchange
    fixed = replace(m, call_costs=(("graph_halo", 1e-3),))
    assert predict(work, (1, 2, 1, 1), fixed).t_halo - two.t_halo == pytest.approx(4e-3)
    assert predict(work, (1, 1, 1, 1), fixed).t_halo == 0


@mpi_case(nprocs=3, timeout=120)
def test_graph_halo_call_is_measured_between_pairs(comm):
    from hpcpar.plan.calibrate import graph_halo_call

    t = graph_halo_call(comm, rows=200, halo=20, iters=5, rounds=2)
    if comm.Get_rank() < 2:
        assert 0 < t < 0.5
    else:
        assert t == 0.0   # the odd last rank has no partner


@mpi_case(nprocs=2, timeout=300)
def test_graph_partition_counts_match_the_run(comm):
    """The planner's parts for 2 ranks (owned, in-edges, halo) are what DistGraph builds."""
    from hpcpar import ProcessGrid
    from hpcpar.graph.distgraph import DistGraph
    from hpcpar.plan.job import workload_from_job
    from hpcpar.run.workloads.graph import make_graph_file

    with shared_tmpdir(comm, prefix="hpcpar-plan-gnn-") as tmp:
        path = str(tmp / "cora.h5")
        if comm.Get_rank() == 0:
            make_graph_file(path, {"make": "cora"})
        comm.Barrier()
        g = DistGraph.from_hdf5(path, ProcessGrid(1, 2, 1, 1, comm=comm), method="metis")
        work = workload_from_job("jobs/demo-gcn-cora.toml", [f"data.path={path}"])
        part = work.graph.partition(2)[comm.Get_rank()]
        assert (part.owned, part.halo) == (g.num_owned, g.num_halo)
        assert part.edges == int(g.in_degree.sum()) and part.peers == 1
        assert work.graph.widths == (g.num_features, 16, g.num_classes)


def job(grid, tp, steps=6):
    raw = {"job": {"name": "t"}, "grid": dict(zip(("data", "x", "y", "z"), grid)),
           "model": {"kind": "cosmoflow", "n_conv_blocks": 2, "base_filters": 4,
                     "dense": [32, 16], "tensor_parallel": tp, "tp_min_features": 8},
           "data": {"source": "synthetic", "size": 16, "channels": 2, "samples": 32},
           # SGD: Adam's per-element normalisation would hide a gradient off by a constant
           # factor (a replicated layer summed over the spatial group)
           "train": {"steps": steps, "global_batch": 4, "lr": 0.003, "log_every": 1,
                     "optimizer": "sgd", "momentum": 0.9},
           "checkpoint": {"every": 0, "keep": 1}}
    return build_job(raw)


@mpi_case(nprocs=2, timeout=400)
def test_tensor_parallel_from_a_job_file_trains_like_the_plain_model(comm):
    from hpcpar.nn.tensor_parallel import TensorParallelLinear
    from hpcpar.run.checkpoint.store import list_checkpoints
    from hpcpar.run.trainer import train

    def final(run_dir):
        newest = list_checkpoints(run_dir / "checkpoints")[0]
        return torch.load(newest / "model.pt", weights_only=True)

    with shared_tmpdir(comm, prefix="hpcpar-tp-job-") as tmp:
        ref = train(job((1, 2, 1, 1), False), tmp / "ref", comm=comm)
        for grid in ((1, 2, 1, 1), (1, 1, 1, 2)):   # split over x (features), z (batch, shards)
            name = "tp-" + "x".join(map(str, grid))
            res = train(job(grid, True), tmp / name, comm=comm)
            assert abs(res.metrics["final_train_loss"] - ref.metrics["final_train_loss"]) < 1e-5
            comm.Barrier()
            a, b = final(tmp / name), final(tmp / "ref")
            assert a.keys() == b.keys()   # the checkpoint gathers the shards: plain keys, shapes
            for k in a:
                torch.testing.assert_close(a[k], b[k], rtol=2e-5, atol=2e-6, msg=k)
    # the dense layers really are split (both sides >= 8; the 16 -> 4 output layer is not)
    from hpcpar import ProcessGrid
    from hpcpar.run.workloads.volume import CosmoFlowWorkload

    w = CosmoFlowWorkload(job((1, 2, 1, 1), True), ProcessGrid(1, 2, 1, 1, comm=comm),
                          torch.device("cpu"))
    kinds = [type(m).__name__ for m in w.build_model().modules()
             if isinstance(m, (torch.nn.Linear, TensorParallelLinear))]
    assert kinds == ["TensorParallelLinear", "TensorParallelLinear", "Linear"]
    w.close()


def test_a_gat_job_is_refused_in_one_line_not_planned_as_gcn(run_cli):
    """The graph cost model is GCN/SAGE's: a GAT job is refused rather than planned wrongly."""
    rc, _, err = run_cli(["plan", "jobs/demo-gat-cora.toml", "-n", "2"])
    assert rc == 2 and err.strip().splitlines() == [
        "hpcpar: error: [model] kind 'gat': the planner models full-graph gcn and sage jobs, "
        "not gat; plan a gcn job of the same widths for an estimate"]
