"""No whole-device synchronisation per message: every wait of the host for device work goes
through :mod:`hpcpar.parallel.device_sync`, and a training step of a spatial model (halos,
global norm, pooling, gradient buckets) waits per message only for an event after the
message's own work, on the MPI path and on the staged path alike."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import torch
from torch import nn

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import randn, spatial_slices

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ROOT / "hpcpar" / "parallel" / "device_sync.py"


def test_only_the_hook_module_synchronises():
    """A ``.synchronize()`` (torch.cuda's, a stream's, an event's) anywhere else in the
    package would be a wait the step's count cannot see."""
    bad = []
    for folder in ("hpcpar", "kernels", "analysis"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == HOOKS:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr in ("synchronize", "device_synchronize"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "synchronisation outside hpcpar.parallel.device_sync: " + ", ".join(bad)


GSHAPE = (8, 7, 6)


class Net(nn.Module):
    def __init__(self, grid):
        from hpcpar.nn.conv import SpatialConv3d
        from hpcpar.nn.gather import SpatialAdaptiveAvgPool3d
        from hpcpar.nn.norm import SpatialBatchNorm3d

        super().__init__()
        self.conv1 = SpatialConv3d(2, 4, 3, padding=1, grid=grid)
        self.norm = SpatialBatchNorm3d(4, grid=grid)
        self.conv2 = SpatialConv3d(4, 4, 3, padding=1, grid=grid)
        self.pool = SpatialAdaptiveAvgPool3d(1, grid=grid)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        x = self.conv2(torch.relu(self.norm(self.conv1(x))))
        return self.head(self.pool(x).flatten(1))


def _step_waits(comm) -> dict:
    """The waits, by kind, of one training step (forward, backward, gradient sync,
    optimizer step) of a spatial model on 2 ranks split along x."""
    from hpcpar.parallel.counters import COUNTERS
    from hpcpar.parallel.device_sync import COUNTS
    from hpcpar.parallel.grid import ProcessGrid
    from hpcpar.sync.ddp import DistributedDataParallel

    grid = ProcessGrid(data=1, x=2, comm=comm)
    torch.manual_seed(0)
    model = Net(grid)
    ddp = DistributedDataParallel(model, grid)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = randn((2, 2, *GSHAPE), 1)[spatial_slices(GSHAPE, grid)].contiguous()
    ddp(x).sum().backward()     # first step: plans and buckets are made; not counted
    opt.step()
    opt.zero_grad()
    before, sent = dict(COUNTS), COUNTERS.bytes_halo
    ddp(x).square().sum().backward()
    opt.step()
    waits = {k: COUNTS[k] - before.get(k, 0) for k in ("device", "stream", "event")}
    assert COUNTERS.bytes_halo > sent   # halo faces did travel
    ddp.remove_hooks()
    grid.free()
    return waits


@mpi_case(nprocs=(2,), timeout=120)
def test_a_step_never_waits_for_the_whole_device(comm):
    for staged in ("0", "1"):   # MPI reads the tensors; MPI reads host copies of them
        os.environ["HPCPAR_FORCE_STAGING"] = staged
        try:
            waits = _step_waits(comm)
        finally:
            del os.environ["HPCPAR_FORCE_STAGING"]
        assert waits["device"] == 0 and waits["stream"] == 0, (staged, waits)
        # 2 halo messages per conv and direction, norm and pooling collectives, a bucket
        assert waits["event"] >= 8, (staged, waits)
