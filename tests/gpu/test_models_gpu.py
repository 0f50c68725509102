"""On one CUDA device shared by 2 ranks: spatial CosmoFlow and UNet3D equal the
single-process model on the device, DDP equals single process, a distributed GCN equals the
single-process GCN, and bf16 autocast runs the spatial model close to the single-process one.
Each check is a function of the device, so the same code is the CPU oracle's twin."""

import torch

from hpcpar.testing import mpi_case
from hpcpar.testing.gpu import requires_gpu, skip_without_gpu
from hpcpar.testing.oracles import check_spatial_model, close, randn


def on_gpu(test):
    """The ``gpu`` marks on one test: this module's CPU twin below runs everywhere."""
    for mark in requires_gpu():
        test = mark(test)
    return test


def exact_math():
    """fp32 on GPUs defaults to TF32 in convolutions: compare in true fp32/fp64."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def cnn_models(device, comm):
    from hpcpar.models import CosmoFlow, UNet3D
    from hpcpar.parallel.grid import ProcessGrid

    grid = ProcessGrid(data=1, x=comm.Get_size(), comm=comm)
    for dtype in (torch.float64, torch.float32):
        torch.manual_seed(1)
        cf = CosmoFlow.small(input_size=16, n_conv_blocks=2, base_filters=3,
                             dense=(16, 8)).to(dtype)
        check_spatial_model(grid, cf, randn((2, 4, 16, 16, 16), 11, dtype), 7,
                            f"CosmoFlow {dtype}", replicated_output=True, slack=10.0,
                            device=device)
        torch.manual_seed(2)
        unet = UNet3D(in_channels=1, out_channels=2, base_filters=2, depth=2).to(dtype)
        check_spatial_model(grid, unet, randn((2, 1, 17, 13, 11), 21, dtype), 7,
                            f"UNet3D {dtype}", slack=10.0, device=device)


def ddp_matches(device, comm, grad_sync="mpi"):
    """Two steps of SGD under DDP (each rank its share of the batch) vs one process on the
    whole batch: parameters after each step."""
    from hpcpar.sync.ddp import DistributedDataParallel

    size, rank = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(),
                              torch.nn.Linear(32, 4)).double().to(device)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4)).double().to(device)
    model.load_state_dict(ref.state_dict())
    ddp = DistributedDataParallel(model, grad_sync=grad_sync, first_bucket_mb=0.001)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for step in range(2):
        x = randn((3 * size, 6), 100 + step, torch.float64).to(device)
        y = randn((3 * size, 4), 200 + step, torch.float64).to(device)
        mine = slice(3 * rank, 3 * rank + 3)
        for o in opts:
            o.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ((ddp(x[mine]) - y[mine]) ** 2).mean().backward()
        for o in opts:
            o.step()
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            close(a.detach().cpu(), b.detach().cpu(), f"DDP ({grad_sync}) step {step} {name}")
    ddp.remove_hooks()


def gcn_matches(device, comm):
    from hpcpar.graph import DistGraph
    from hpcpar.graph._csr import csr_to_edges
    from hpcpar.graph.generate import power_law_community_graph
    from hpcpar.graph.metrics import masked_loss
    from hpcpar.models import GCN
    from hpcpar.parallel.comm import allreduce_
    from hpcpar.testing.oracles import dense_operators, gnn_forward, gnn_loss

    g = power_law_community_graph(150, 4, communities=4, features=6, classes=3, seed=3)
    e = csr_to_edges(g["indptr"], g["indices"])
    x, y, masks = g["x"], g["y"], g["masks"]
    n = x.shape[0]
    torch.manual_seed(0)
    model = GCN(x.shape[1], 8, int(y.max()) + 1, dropout=0.0, seed=11).double()
    state = {k: v.detach().clone().requires_grad_(True)
             for k, v in model.state_dict().items() if k != "_extra_state"}
    xr = torch.tensor(x, dtype=torch.float64)
    logits = gnn_forward(state, xr, dense_operators(e, n), "gcn")
    gnn_loss(logits, torch.as_tensor(y), torch.as_tensor(masks["train"])).backward()
    graph = DistGraph.from_global(e, n, x, comm, y=y, masks=masks, method="block").to(device)
    model = model.to(device)
    out = model(graph.x.double(), graph)
    assert out.device.type == torch.device(device).type
    masked_loss(out, graph).backward()
    torch.testing.assert_close(graph.gather(out).cpu(), logits.detach(), rtol=1e-9, atol=1e-11)
    for name, p in model.named_parameters():
        torch.testing.assert_close(allreduce_(p.grad.clone(), comm).cpu(), state[name].grad,
                                   rtol=1e-9, atol=1e-11, msg=name)


def bf16_autocast_close(device, comm):
    """The spatial CosmoFlow under bf16 autocast: finite, and within bf16 accuracy of the
    single-process model under the same autocast."""
    from hpcpar.models import CosmoFlow
    from hpcpar.nn import spatialize
    from hpcpar.parallel.grid import ProcessGrid
    from hpcpar.parallel.spatial import local_slices

    grid = ProcessGrid(data=1, x=comm.Get_size(), comm=comm)
    torch.manual_seed(1)
    model = CosmoFlow.small(input_size=16, n_conv_blocks=2, base_filters=4,
                            dense=(16, 8)).to(device)
    sp = spatialize(model, grid)
    x = randn((2, 4, 16, 16, 16), 11).to(device)
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        want = model(x)
        got = sp(x[local_slices(x.shape, grid)])
    assert got.dtype == torch.bfloat16 and torch.isfinite(got.float()).all()
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < 5e-2, f"bf16 spatial vs single process: rel err {err:.3g}"
    got.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in sp.parameters() if p.grad is not None)


@on_gpu
@mpi_case(nprocs=(2,), timeout=300)
def test_spatial_cnns_on_one_shared_gpu(comm):
    skip_without_gpu()
    exact_math()
    cnn_models("cuda", comm)


@on_gpu
@mpi_case(nprocs=(2,), timeout=180)
def test_ddp_gcn_and_bf16_on_one_shared_gpu(comm):
    skip_without_gpu()
    exact_math()
    ddp_matches("cuda", comm)
    gcn_matches("cuda", comm)
    bf16_autocast_close("cuda", comm)


@mpi_case(nprocs=(2,), timeout=300)
def test_the_same_checks_on_the_cpu(comm):
    """The GPU checks' code on the CPU, in every CI run: a check that is wrong for a reason
    of its own (a split head's weight compared whole, as the first GPU run found) fails here
    instead of waiting for a device."""
    cnn_models("cpu", comm)
    ddp_matches("cpu", comm)
    gcn_matches("cpu", comm)
    bf16_autocast_close("cpu", comm)
