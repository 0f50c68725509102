"""``hpcpar predict`` / ``hpcpar.predict``: the output read back with plain h5py equals the
one-process whole-volume forward (odd prime sizes along the split axes), the halo-aware slab
tiling equals the untiled result, an existing file is replaced only with --force, and a
killed prediction stays marked incomplete until a rerun completes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
import torch

from hpcpar.testing import mpi_case, shared_tmpdir
from hpcpar.testing.oracles import on_grids

SHAPE = (3, 1, 23, 17, 6)  # N, C, D, H, W: 23 and 17 prime, split over x and y


def trained_unet():
    """A UNet3D with batch norm whose statistics and affine terms are not the defaults (as
    after training; positive shifts keep the ReLUs alive), in eval mode."""
    from hpcpar.models import UNet3D

    torch.manual_seed(5)
    model = UNet3D(in_channels=1, out_channels=3, base_filters=2, depth=2)
    g = torch.Generator().manual_seed(6)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm3d):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(n, generator=g) + 0.5)
            m.bias.data.copy_(torch.rand(n, generator=g) * 0.5 + 0.2)
    return model.eval()


def volume(path, shape, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    with h5py.File(path, "w") as f:
        f["x"] = x
    return x


def reference(model, x):
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def read_back(path):
    with h5py.File(path, "r") as f:
        return f["y"][()], int(f.attrs["complete"]), f["y"].is_virtual


@mpi_case(nprocs=(4,), timeout=600)
def test_predict_equals_one_process_forward(comm):
    from hpcpar import predict
    from hpcpar.run.predict import Post

    model = trained_unet()
    with shared_tmpdir(comm, prefix="hpcpar-test-predict-") as tmp:
        src = os.path.join(tmp, "in.h5")
        if comm.rank == 0:
            volume(src, SHAPE)
        comm.Barrier()
        with h5py.File(src, "r") as f:
            x = f["x"][()]
        ref = reference(model, x)

        def run(grid):
            out = os.path.join(tmp, f"{grid.spec()}.h5")
            predict(model, src, out, grid)
            labels = os.path.join(tmp, f"{grid.spec()}-labels.h5")
            predict(model, src, labels, grid, post=Post(argmax=True, softmax=True,
                                                        dtype="uint8"))
            if grid.rank == 0:
                y, complete, virtual = read_back(out)
                assert complete == 1 and virtual == (not h5py.get_config().mpi)
                assert y.shape == ref.shape and y.dtype == np.float32
                np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5, err_msg=grid.spec())
                lab, _, _ = read_back(labels)
                assert lab.dtype == np.uint8 and lab.shape == (SHAPE[0], 1, *SHAPE[2:])
                sure = np.sort(ref, axis=1)
                clear = (sure[:, -1] - sure[:, -2]) > 1e-4   # no near-ties
                assert (lab[:, 0] == ref.argmax(axis=1))[clear].all()

        on_grids(comm, [(1, 2, 1, 1), (1, 2, 2, 1), (2, 2, 1, 1)], run)


@mpi_case(nprocs=(1, 2), timeout=600)
def test_tiled_equals_untiled(comm):
    """In float64, so that a margin too small by a few voxels (an error of 1e-8 here) shows."""
    from hpcpar import ProcessGrid, predict
    from hpcpar.run.predict import Post
    from hpcpar.run.slabs import model_reach, slab_plan

    model = trained_unet().double()
    shape = (1, 1, 131, 7, 5)   # 131 prime: slabs of 8 (rounded to the stride 4) cut it
    reach = model_reach(model, 1, shape[3:])
    slabs = slab_plan(shape[2], 8, reach)
    assert reach.stride == 4 and len(slabs) == 17
    assert any(0 < s.lo or s.hi < shape[2] for s in slabs)   # some slabs do not see it all
    f64 = Post(dtype="float64")
    with shared_tmpdir(comm, prefix="hpcpar-test-predict-") as tmp:
        src = os.path.join(tmp, "in.h5")
        if comm.rank == 0:
            volume(src, shape, seed=3)
        comm.Barrier()
        grid = ProcessGrid(1, comm.size, 1, 1, comm=comm)
        whole, tiled = os.path.join(tmp, "whole.h5"), os.path.join(tmp, "tiled.h5")
        predict(model, src, whole, grid, post=f64)
        record = predict(model, src, tiled, grid, max_slab=8, post=f64)
        assert record["slabs"] == 17 and record["margin"] == reach.margin
        if comm.rank == 0:
            a, b = read_back(whole)[0], read_back(tiled)[0]
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-12)
            with h5py.File(src, "r") as f:
                x = torch.from_numpy(f["x"][()]).double()
            np.testing.assert_allclose(b, reference(model, x.numpy()), rtol=0, atol=1e-12)
        grid.free()


NET = """
from hpcpar.models import UNet3D


class Net(UNet3D):
    def __init__(self):
        super().__init__(in_channels=1, out_channels=3, base_filters=2, depth=2)
"""


@pytest.fixture()
def model_files(tmp_path):
    model = trained_unet()
    (tmp_path / "net.py").write_text(textwrap.dedent(NET))
    torch.save(model.state_dict(), tmp_path / "w.pt")
    return model, ["--model", f"{tmp_path / 'net.py'}:Net", "--weights", str(tmp_path / "w.pt")]


def test_force_rule_and_incomplete_output(run_cli, tmp_path, model_files):
    model, flags = model_files
    src = tmp_path / "in.h5"
    x = volume(src, (40, 1, 9, 8, 7))
    out = tmp_path / "out.h5"
    ref = reference(model, x)

    # a prediction killed after its first sample: OUT exists, marked incomplete
    cmd = [sys.executable, "-m", "hpcpar.run.predict", *flags, "--data", str(src),
           "--out", str(out), "--grid", "1x1x1x1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if "sample 1 " in line:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with h5py.File(out, "r") as f:     # (its data: the parts the killed rank had flushed)
        assert int(f.attrs["complete"]) == 0

    # a rerun, without --force, restarts it and completes it
    rc, _, err = run_cli(["predict", *flags, "--data", str(src), "--out", str(out)])
    assert rc == 0, err
    y, complete, _ = read_back(out)
    assert complete == 1
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5)
    assert "voxels/s per rank" in err and "peak memory" in err

    # a finished prediction, or a user's own file, is never overwritten without --force
    user = tmp_path / "mine.h5"
    with h5py.File(user, "w") as f:
        f["y"] = np.arange(3)
    before = user.read_bytes()
    for path in (out, user):
        kept = path.read_bytes()
        rc, _, err = run_cli(["predict", *flags, "--data", str(src), "--out", str(path)])
        assert rc == 2 and "--force" in err and err.count("\n") == 1, err
        assert path.read_bytes() == kept
    assert user.read_bytes() == before
    rc, _, err = run_cli(["predict", *flags, "--data", str(src), "--out", str(user), "--force",
                          "--argmax"])
    assert rc == 0, err
    y, complete, _ = read_back(user)
    assert complete == 1 and y.shape == (40, 1, 9, 8, 7)


def test_run_directory_model_on_two_ranks(run_cli, tmp_path):
    """The model of a run's newest checkpoint (written on 1 rank) predicts on 2 ranks; the
    label channel of a unet3d sample is not read."""
    from hpcpar.models import UNet3D
    from hpcpar.run.checkpoint.store import list_checkpoints
    from tests.support.cli_run import CliRun, tiny_job_toml

    job = tmp_path / "unet.toml"
    job.write_text(tiny_job_toml(x=1, kind="unet3d", steps="2", checkpoint="every = 2")
                   .replace("n_conv_blocks = 2\n", "depth = 1\n").replace("dense = [16]\n", ""))
    run = CliRun([job, "-n", "1", "--run-dir", tmp_path / "run"], tmp_path / "run.out")
    assert run.finish(timeout=300) == 0, (tmp_path / "run.out").read_text()
    model = UNet3D(in_channels=1, out_channels=2, base_filters=4, depth=1)
    step = list_checkpoints(tmp_path / "run" / "checkpoints")[0]
    model.load_state_dict(torch.load(step / "model.pt", weights_only=True))
    src = tmp_path / "in.h5"
    x = volume(src, (2, 2, 19, 13, 8), seed=4)
    out = tmp_path / "out.h5"
    rc, _, err = run_cli(["predict", str(tmp_path / "run"), "--data", str(src), "--out",
                          str(out), "-n", "2", "--grid", "1x2x1x1"])
    assert rc == 0, err
    y, complete, _ = read_back(out)
    assert complete == 1
    np.testing.assert_allclose(y, reference(model.eval(), x[:, :1]), rtol=0, atol=1e-5)
    rc, _, err = run_cli(["predict", str(step), "--data", str(src), "--out", str(out),
                          "--force", "--softmax"])
    assert rc == 0, err
    ref = torch.softmax(torch.from_numpy(reference(model, x[:, :1])), dim=1).numpy()
    np.testing.assert_allclose(read_back(out)[0], ref, rtol=0, atol=1e-5)
