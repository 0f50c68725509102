"""``[train] channels_last``: every convolution of a volume job runs in channels-last order,
the UNet3D demo's one-channel input and its transposed convolutions included."""

import pytest
import torch

from hpcpar.formats.jobspec import build_job

CL = torch.channels_last_3d


def _order(t: torch.Tensor) -> str:
    return "NCDHW" if t.is_contiguous() else "CL" if t.is_contiguous(memory_format=CL) \
        else "other"


@pytest.mark.parametrize("channels_last", [True, False])
def test_unet3d_job_runs_every_convolution_in_the_order_asked(channels_last):
    """A one-channel input is dense in both orders and a transposed convolution on torch's
    own kernel returns NCDHW: with only the input converted, every layer of the UNet3D demo
    ran in NCDHW (oneDNN's slow path for few channels). The job puts the weights in the
    order too, so every convolution after the first runs channels-last (the first, whose
    one-channel input and weight are dense in both orders, returns NCDHW: converting its
    output measured 0.94x the demo's step at 96³); with ``channels_last = false`` nothing
    changes."""
    from mpi4py import MPI

    from hpcpar.parallel.grid import ProcessGrid
    from hpcpar.run.workloads.volume import UNet3DWorkload

    job = build_job({
        "job": {"name": "order"}, "grid": {"data": 1, "x": 1},
        "model": {"kind": "unet3d", "base_filters": 4, "depth": 2},
        "data": {"source": "synthetic", "size": 40, "channels": 2, "samples": 2,
                 "val_samples": 2},
        "train": {"steps": 1, "global_batch": 1, "channels_last": channels_last}})
    w = UNet3DWorkload(job, ProcessGrid(1, 1, 1, 1, comm=MPI.COMM_SELF), torch.device("cpu"))
    try:
        model = w.build_model()
        seen = {}
        for name, m in model.named_modules():
            if isinstance(m, (torch.nn.Conv3d, torch.nn.ConvTranspose3d)) and \
                    max(m.kernel_size) > 1:
                m.register_forward_hook(lambda m, i, o, name=name: seen.update({name: _order(o)}))
        x = torch.randn(1, 1, 40, 40, 40)
        with torch.no_grad():
            model(x.contiguous(memory_format=CL) if channels_last else x)
    finally:
        w.close()
    want = "CL" if channels_last else "NCDHW"
    convs = {n: o for n, o in seen.items() if not n.startswith("ups.") and n != "encoders.0.0"}
    assert len(convs) == 9 and set(convs.values()) == {want}, sorted(seen.items())
