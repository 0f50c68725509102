"""The replica check (hpcpar.sync.replicas): identical replicas pass; a parameter perturbed on
one rank is named with that rank, on every rank; shards are compared across data only."""

from __future__ import annotations

import pytest
import torch

from hpcpar.testing import mpi_case


@mpi_case(nprocs=(4,), timeout=120)
def test_a_perturbed_replica_is_caught(comm):
    import hpcpar
    from hpcpar.errors import CommError
    from hpcpar.sync.replicas import check_replicas

    grid = hpcpar.ProcessGrid(data=2, x=2, comm=comm)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    check_replicas(model, grid)  # identical everywhere: passes
    if grid.rank == 3:
        with torch.no_grad():
            model[1].bias[0] += 1e-7  # one ulp-scale drift on one rank
    with pytest.raises(CommError, match=r"parameter '1.bias' differs on rank\(s\) \[3\]"):
        check_replicas(model, grid)
    # a shard differs across the spatial group by design, and is compared over data only
    with torch.no_grad():
        model[0].weight.fill_(float(grid.coords[1]))
        model[1].bias.zero_()
    check_replicas(model, grid, shards=frozenset({"0.weight"}))
    if grid.coords[0] == 1 and grid.coords[1] == 0:
        with torch.no_grad():
            model[0].weight[0, 0] = -1.0
    with pytest.raises(CommError, match=r"'0.weight' differs on data-axis rank\(s\) \[1\]"):
        check_replicas(model, grid, shards=frozenset({"0.weight"}))
