"""The planner sees what the dispatcher sees: ``trace_layers`` classifies each torch call by
:mod:`hpcpar.nn.optable`, as ``spatialize`` does, so a model and its functional twin (the
same layers written with ``F.conv3d``, ``F.max_pool3d``, ...) give the same layers, the same
predicted step and the same activation bytes. Tracing by module type made the twin one
pointwise op of cost 0."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpcpar.plan import memory
from hpcpar.plan.machine import Link, Machine
from hpcpar.plan.planner import Workload, predict, trace_layers

M = Machine("test", ranks_per_node=4, flops=1e9, mem_bw=1e10, mem_per_rank=1e12, io_bw=1e9,
            intra=Link(1e-6, 1e9), inter=Link(1e-5, 1e8))
SHAPE = (2, 16, 12, 20)


class Modules(nn.Module):
    """Convolutions (strided, dilated, transposed), batch norm, activations, pools, a
    residual sum, a concatenated skip, a global pool and a dense head."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv3d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm3d(4)
        self.act = nn.LeakyReLU(0.1)
        self.pool = nn.MaxPool3d(2)
        self.c2 = nn.Conv3d(4, 4, 3, padding=2, dilation=2)
        self.avg = nn.AvgPool3d(2, ceil_mode=True)
        self.up = nn.ConvTranspose3d(4, 4, 2, stride=2)
        self.c3 = nn.Conv3d(8, 6, 3, stride=2, padding=1)
        self.gap = nn.AdaptiveAvgPool3d(1)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        h = self.act(self.bn(self.c1(x)))
        p = self.pool(h)
        p = p + self.act(self.c2(p))
        u = self.up(self.avg(p))
        h = torch.cat([h[:, :, :u.shape[2], :u.shape[3], :u.shape[4]], u], 1)
        return self.fc(self.flat(self.gap(torch.relu(self.c3(h)))))


class Functional(Modules):
    """The same parameters, every layer written as a function."""

    def forward(self, x):
        bn = self.bn
        h = F.leaky_relu(F.batch_norm(F.conv3d(x, self.c1.weight, self.c1.bias, padding=1),
                                      bn.running_mean, bn.running_var, bn.weight, bn.bias,
                                      training=True), 0.1)
        p = F.max_pool3d(h, 2)
        p = p + F.leaky_relu(F.conv3d(p, self.c2.weight, self.c2.bias, padding=2,
                                      dilation=2), 0.1)
        u = F.conv_transpose3d(F.avg_pool3d(p, 2, ceil_mode=True), self.up.weight,
                               self.up.bias, stride=2)
        h = torch.cat([h[:, :, :u.shape[2], :u.shape[3], :u.shape[4]], u], 1)
        h = torch.relu(F.conv3d(h, self.c3.weight, self.c3.bias, stride=2, padding=1))
        return F.linear(F.adaptive_avg_pool3d(h, 1).flatten(1), self.fc.weight, self.fc.bias)


class Positional(Modules):
    """The same functions, every argument by position (the tracer reads them by torch's
    names, as the dispatcher does)."""

    def forward(self, x):
        bn = self.bn
        h = F.leaky_relu(F.batch_norm(F.conv3d(x, self.c1.weight, self.c1.bias, 1, 1),
                                      bn.running_mean, bn.running_var, bn.weight, bn.bias,
                                      True), 0.1)
        p = F.max_pool3d(h, 2)
        p = p + F.leaky_relu(F.conv3d(p, self.c2.weight, self.c2.bias, 1, 2, 2, 1), 0.1)
        u = F.conv_transpose3d(F.avg_pool3d(p, 2, None, 0, True), self.up.weight,
                               self.up.bias, 2, 0, 0, 1, 1)
        h = torch.cat([h[:, :, :u.shape[2], :u.shape[3], :u.shape[4]], u], 1)
        h = torch.relu(F.conv3d(h, self.c3.weight, self.c3.bias, 2, 1))
        return F.linear(F.adaptive_avg_pool3d(h, 1).flatten(1), self.fc.weight, self.fc.bias)


def _row(layer, parts=(2, 2, 1)):
    halos = tuple(fn(n, p, 0) for fn, n, p in zip(layer.halo, layer.in_shape[1:], parts))
    return (layer.kind, layer.spatial, layer.in_shape, layer.out_shape, layer.params,
            layer.flops, layer.inputs, layer.keeps, layer.alias, layer.kernel, layer.extra,
            halos)


@pytest.mark.parametrize("twin", [Functional, Positional])
def test_a_model_and_its_functional_twin_trace_alike(twin):
    module_layers = trace_layers(Modules(), SHAPE)
    twin_layers = trace_layers(twin(), SHAPE)
    kinds = [layer.kind for layer in module_layers]
    assert kinds.count("conv") == 3 and kinds.count("pool") == 2 and "convT" in kinds \
        and "gather" in kinds and "linear" in kinds, kinds
    assert [_row(a) for a in module_layers] == [_row(b) for b in twin_layers]


@pytest.mark.parametrize("grid", [(1, 1, 1, 1), (1, 2, 1, 1), (1, 2, 2, 1), (2, 2, 1, 1)])
def test_a_model_and_its_functional_twin_plan_alike(grid):
    plans, acts = [], []
    for make in (Modules, Functional):
        work = Workload(make.__name__, trace_layers(make(), SHAPE), SHAPE, global_batch=4)
        plans.append(predict(work, grid, M))
        acts.append(memory.activations(work, grid))
    assert plans[0].t_compute > 0 and plans[0].t_compute == plans[1].t_compute
    assert plans[0].t_step == plans[1].t_step and plans[0].t_halo == plans[1].t_halo
    assert plans[0].mem_bytes == plans[1].mem_bytes
    assert acts[0] == acts[1] and acts[0][0] > 0
