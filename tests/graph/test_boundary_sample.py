"""BNS-GCN boundary sampling (``[model] boundary_sample``): at p = 1 the sampled exchange is
bit-identical to the exact one; at p < 1 the distributed GCN/SAGE equals a single-process
model whose operator holds exactly the sampled edge set (outputs and every gradient), the
halo bytes drop by ~p, the sample is deterministic and evaluation stays exact."""

import os

import numpy as np
import pytest
import torch

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import dense_operators, gnn_forward, gnn_loss, load_cora

SEED, CALL = 11, 3
CORA_JOB = os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "demo-gcn-cora.toml")


def _graph(comm, method):
    from hpcpar import ProcessGrid
    from hpcpar.graph import DistGraph

    e, x, y, masks = load_cora()
    grid = ProcessGrid(1, 2, comm.Get_size() // 2, comm=comm)  # 1x2x1x1 and 1x2x2x1
    g = DistGraph.from_global(e, x.shape[0], x, grid, y=y, masks=masks, method=method,
                              seed=1, row_normalize=True)
    return g, e, x, y, masks


def _model(g, conv, p):
    from hpcpar.models import GCN

    torch.manual_seed(0)
    kw = {} if p is None else {"boundary_sample": p}  # None: the option not given
    model = GCN(g.num_features, 8, g.num_classes, dropout=0.5, conv=conv, seed=SEED,
                **kw).double()
    model.train()
    model.calls = CALL
    return model


def _sampled_operators(comm, g, dense, p):
    """The dense single-process operators restricted to this step's sampled edge set: each
    rank's edges to its halo vertices scaled by that vertex's ``n / k`` (0: not sampled)."""
    view = g.boundary_sample(p, SEED, CALL)
    scale = torch.ones(dense["gcn"].shape, dtype=torch.float64)
    for rows, halo, s in comm.allgather((g.global_ids, g.halo_ids, view.plan.halo_scale)):
        scale[np.ix_(rows, halo)] = torch.from_numpy(s)
    return {k: dense[k] * scale for k in ("gcn", "mean")}


def _run(comm, g, model):
    """Logits, input gradient and parameter gradients (SUMMED over ranks) of one step."""
    from hpcpar.graph.metrics import masked_loss
    from hpcpar.parallel.comm import allreduce_

    xl = g.x.double().clone().requires_grad_(True)
    out = model(xl, g)
    masked_loss(out, g).backward()
    for q in model.parameters():
        allreduce_(q.grad, comm)
    return out, xl.grad, {k: q.grad for k, q in model.named_parameters()}


@mpi_case(nprocs=(2, 4), timeout=300)
def test_sampled_operator_is_exact(comm):
    for method in ("metis", "random"):
        g, e, x, y, masks = _graph(comm, method)
        dense = dense_operators(e, x.shape[0])
        xs = g.gather(g.x).double()  # the row-normalised features, in global order
        p = 0.1 if method == "metis" else 0.5
        for conv in ("gcn", "sage"):
            model = _model(g, conv, p)
            state = {k: v.detach().clone().requires_grad_(True)
                     for k, v in model.state_dict().items() if k != "_extra_state"}
            out, x_grad, grads = _run(comm, g, model)
            ops = _sampled_operators(comm, g, dense, p)
            xr = xs.clone().requires_grad_(True)
            ref = gnn_forward(state, xr, ops, conv, p=0.5, seed=SEED, call=CALL)
            gnn_loss(ref, torch.as_tensor(y), torch.as_tensor(masks["train"])).backward()
            what = f"{method} {conv} p={p} rank {comm.Get_rank()}/{comm.Get_size()}"
            tol = dict(rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(g.gather(out), ref.detach(), **tol, msg=what)
            torch.testing.assert_close(g.gather(x_grad), xr.grad, **tol, msg=what)
            for k, q in grads.items():
                torch.testing.assert_close(q, state[k].grad, **tol, msg=f"{what} {k}")
            # not the exact model: the sample really changes the result
            assert not torch.allclose(g.gather(out),
                                      gnn_forward(state, xs, dense, conv, p=0.5,
                                                  seed=SEED, call=CALL)), what


@mpi_case(nprocs=(2, 4), timeout=200)
def test_p1_is_bit_identical_and_eval_is_exact(comm):
    from hpcpar.graph._vertex_halo import SampledHaloPlan

    g, *_ = _graph(comm, "metis")
    assert g.boundary_sample(1.0, SEED, CALL) is g
    # the sampled code path itself, at p = 1: every row, scale 1, same bits
    view = g.boundary_sample(0.5, SEED, CALL)
    view.plan = SampledHaloPlan(g.plan, 1.0, SEED, CALL)
    for kind in ("gcn", "mean"):
        xa = g.x.double().clone().requires_grad_(True)
        xb = g.x.double().clone().requires_grad_(True)
        a, b = g.propagate(xa, kind), view.propagate(xb, kind)
        (a * a).sum().backward()
        (b * b).sum().backward()
        assert torch.equal(a, b) and torch.equal(xa.grad, xb.grad), kind
    # a p = 1 model and a model without the option train alike, bit for bit
    for conv in ("gcn", "sage"):
        ra, rb = _run(comm, g, _model(g, conv, 1.0)), _run(comm, g, _model(g, conv, None))
        assert torch.equal(ra[0], rb[0]) and torch.equal(ra[1], rb[1])
        assert all(torch.equal(ra[2][k], rb[2][k]) for k in ra[2])
    # evaluation (model.eval()) ignores the sample: the exact model's logits
    exact, sampled = _model(g, "gcn", None).eval(), _model(g, "gcn", 0.1).eval()
    with torch.no_grad():
        assert torch.equal(exact(g.x.double(), g), sampled(g.x.double(), g))


@mpi_case(nprocs=(2, 4), timeout=200)
def test_halo_bytes_drop_by_p_and_sample_is_deterministic(comm):
    g, *_ = _graph(comm, "metis")
    g.operator("gcn")  # built first: its one-off degree exchange is not part of a step

    def step_bytes(p):
        before = g.plan.bytes_sent
        _run(comm, g, _model(g, "gcn", p))
        return comm.allreduce(g.plan.bytes_sent - before)

    exact = step_bytes(None)
    for p in (0.1, 0.25):
        ratio = step_bytes(p) / exact
        assert abs(ratio - p) < 0.02, (p, ratio)
    a = g.boundary_sample(0.3, SEED, CALL).plan
    b = g.boundary_sample(0.3, SEED, CALL).plan
    c = g.boundary_sample(0.3, SEED, CALL + 1).plan
    assert np.array_equal(a.halo_scale, b.halo_scale)
    assert np.array_equal(a.send_index_np, b.send_index_np)
    assert not np.array_equal(a.halo_scale, c.halo_scale)  # a fresh sample every step
    sent = np.array(comm.alltoall(a.send_rows))
    assert np.array_equal(sent, np.array(a.recv_rows))  # both sides drew the same counts


def test_bad_p_is_one_line():
    from hpcpar.errors import ConfigError, LayerError
    from hpcpar.formats.jobspec import load_job
    from hpcpar.models import GCN

    for p in (0.0, -0.5, 1.5):
        with pytest.raises((ConfigError,), match=r"\[model\] boundary_sample: .* out of range"
                           ) as exc:
            load_job(CORA_JOB, [f"model.boundary_sample={p}"])
        assert "\n" not in str(exc.value)
        with pytest.raises(LayerError, match="boundary_sample=.*0 < p <= 1") as exc2:
            GCN(4, 4, 2, boundary_sample=p)
        assert "\n" not in str(exc2.value)
    assert load_job(CORA_JOB).model.params["boundary_sample"] == 1.0
