"""The planner's activation memory follows the traced dataflow: what each layer keeps for
backward (as torch's autograd reports it in the trace), which layers read each output (skip
connections, ``torch.cat`` in a forward, in-place layers), and the gradients in flight; its
peak is checked against torch's own allocation trace of hpcpar's model on one rank."""

import json

import pytest
import torch
from torch import nn

from hpcpar.plan import memory
from hpcpar.plan.planner import Workload, trace_layers


class Joins(nn.Module):
    """A skip joined by ``torch.cat`` in forward, activations that keep their input, their
    output or (in place) neither, a pool and an upsampling."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.leaky = nn.LeakyReLU()
        self.inplace = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool3d(2)
        self.up = nn.Upsample(scale_factor=2)
        self.out = nn.Conv3d(8, 2, 1)

    def forward(self, x):
        a = self.relu(self.conv(x))
        b = self.inplace(self.leaky(a))
        return self.out(torch.cat([a, self.up(self.pool(b))], dim=1))


def test_the_trace_records_what_each_layer_reads_and_keeps():
    layers = trace_layers(Joins(), (2, 8, 8, 8))
    got = [(layer.kind, layer.inputs, layer.keeps, layer.alias) for layer in layers]
    assert got == [
        ("conv", (-1,), "in", False),
        ("pointwise", (0,), "out", False),        # ReLU keeps its result
        ("pointwise", (1,), "in", False),         # LeakyReLU its input
        ("pointwise", (2,), "in,out", True),      # in place: the same tensor, no new one
        ("pool", (2,), "none", False),            # hpcpar's pool: its indices only
        ("pointwise", (4,), "none", False),       # nearest upsampling keeps nothing
        ("cat", (1, 5), "", False),               # the functional join is a layer
        ("conv", (6,), "in", False),
    ], got
    assert layers[4].extra == 8.0                 # int64 indices per output element


def test_liveness_of_a_two_conv_chain_by_hand():
    """conv(1->2) then conv(2->2) (1x1x1: no oneDNN copies) on 4^3, fp32, the loaded input
    not copied: forward keeps the first output (the second conv's input); the second conv's
    backward holds it, its gradient, the output's gradient and the copy of its input its
    weight gradient reads: 4 outputs. A copied input is kept too (half an output)."""
    net = nn.Sequential(nn.Conv3d(1, 2, 1), nn.Conv3d(2, 2, 1))
    work = Workload("c", trace_layers(net, (1, 4, 4, 4)), (1, 4, 4, 4), 1, input_copy=False)
    out = 2 * 4 ** 3 * 4
    assert memory.activations(work, (1, 1, 1, 1)) == (out, 4 * out)
    copied = Workload("c", work.layers, (1, 4, 4, 4), 1, input_copy=True)
    assert memory.activations(copied, (1, 1, 1, 1)) == (out + out // 2, 4 * out + out // 2)


def _live_peak(model, x, tmp_path) -> float:
    """Peak bytes allocated during one forward + backward (torch's allocation trace), less
    the parameters' gradients."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    model.zero_grad(set_to_none=True)   # the gradients subtracted below are allocated inside
    with torch.profiler.profile(activities=acts, profile_memory=True) as prof:
        y = model(x.clone())   # the step's own copy of the input, as training makes
        y.float().square().mean().backward()
        del y
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = sorted((e for e in json.loads(path.read_text())["traceEvents"]
                     if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    live = peak = 0
    for e in events:
        live += e["args"]["Bytes"]
        peak = max(peak, live)
    return peak - sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("name,edge", [("cosmoflow", 32), ("cosmoflow", 64), ("unet3d", 64),
                                       ("unet3d", 96), ("joins", 32)])
def test_the_activation_peak_is_torchs_measured_one(name, edge, tmp_path):
    """hpcpar's model on one rank, channels-last as training runs it: the predicted peak
    is within 15% of the allocations torch traced (the planner adds the allocator's share,
    FRAGMENTATION). Both convolution paths: CosmoFlow's pieces and UNet3D's at 64^3 take the
    general one with oneDNN's copies, UNet3D's at 96^3 the boundary one. UNet3D at 64^3 was
    1.34x the prediction while oneDNN's input gradient was copied out twice (now 1.10x)."""
    from hpcpar.models import UNet3D
    from hpcpar.models.cosmoflow import CosmoFlow
    from hpcpar.nn import spatialize
    from hpcpar.plan.calibrate import _one_rank_grid

    make = {"cosmoflow": lambda: CosmoFlow.small(input_size=edge),
            "unet3d": lambda: UNet3D(1, 2, 4, 2), "joins": Joins}[name]
    channels = {"cosmoflow": 4, "unet3d": 1, "joins": 2}[name]
    shape = (channels, edge, edge, edge)
    torch.manual_seed(0)
    cl = torch.channels_last_3d
    model = spatialize(make(), _one_rank_grid()).to(memory_format=cl)
    x = torch.randn(1, *shape).contiguous(memory_format=cl)
    _live_peak(model, x, tmp_path)   # warm-up: one-off buffers
    measured = _live_peak(model, x, tmp_path)
    _, predicted = memory.activations(Workload(name, trace_layers(make(), shape), shape, 1),
                                      (1, 1, 1, 1))
    assert predicted == pytest.approx(measured, rel=0.15), (predicted, measured)
