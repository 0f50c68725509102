"""A user's own model kind: ``[model] kind = "package.module:Callable"`` and the
``hpcpar.workloads`` entry-point group resolve, their keys are validated like the built-ins',
and the example package (examples/segment3d) trains through ``hpcpar run`` on 2 ranks, equal
to 1 rank, resumes from its checkpoint, and its records feed ``sweep`` and ``report``."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcpar.errors import ConfigError
from hpcpar.formats import kinds as base
from hpcpar.formats.jobspec import build_job

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "segment3d"
IMPORT_KIND = "seg3d.workload:Seg3DWorkload"
EP_KIND = "seg3d-test"


def _raw(kind, **data):
    return {"grid": {"data": 1, "x": 2}, "model": {"kind": kind},
            "data": {"path": "volumes.h5", **data}, "train": {"steps": 2, "global_batch": 2}}


def _dist_info(site: Path) -> None:
    """An installed-package stand-in: a dist-info whose entry point names the example kind."""
    info = site / "hpcpar_seg3d_test-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hpcpar-seg3d-test\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text(f"[hpcpar.workloads]\n{EP_KIND} = {IMPORT_KIND}\n"
                                           "broken = seg3d.workload:NoSuchThing\n")


@pytest.fixture()
def user_kinds(tmp_path, monkeypatch):
    for module in set(base._BUILTIN.values()):   # the built-ins register in the real
        importlib.import_module(module)          # registry, not in this test's copy
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.syspath_prepend(str(EXAMPLE))
    _dist_info(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


def test_import_path_kind_validates_like_builtins(user_kinds):
    job = build_job(_raw(IMPORT_KIND))
    assert job.model.kind == IMPORT_KIND
    assert job.model.params == {"width": 8, "classes": 2}          # defaults filled
    assert job.data.params["val_path"] is None
    with pytest.raises(ConfigError, match=r"\[model\] unknown key 'widht' \(did you mean 'width'"):
        build_job(_raw(IMPORT_KIND) | {"model": {"kind": IMPORT_KIND, "widht": 4}})
    with pytest.raises(ConfigError, match=r"\[model\] classes: 1 is out of range"):
        build_job(_raw(IMPORT_KIND) | {"model": {"kind": IMPORT_KIND, "classes": 1}})
    raw = _raw(IMPORT_KIND)
    del raw["data"]["path"]
    with pytest.raises(ConfigError, match=r"\[data\] path: required key is missing"):
        build_job(raw)
    with pytest.raises(ConfigError, match="the same file"):          # the kind's check_job
        build_job(_raw(IMPORT_KIND, val_path="volumes.h5"))


def test_entry_point_kind(user_kinds):
    assert EP_KIND in base.known_kinds()
    assert base.get_workload(EP_KIND).__name__ == "Seg3DWorkload"
    assert build_job(_raw(EP_KIND)).model.params["width"] == 8
    with pytest.raises(ConfigError, match="entry point 'seg3d.workload:NoSuchThing' of "
                                          "hpcpar-seg3d-test .*failed to load"):
        base.get_workload("broken")
    with pytest.raises(ConfigError, match=f"did you mean '{EP_KIND}'.*package.module:Workload"):
        base.get_workload("seg3d-tset")


@pytest.mark.parametrize("kind, message", [
    ("no_such_pkg.mod:W", "cannot import module 'no_such_pkg'"),
    ("seg3d.workload:Seg3DWorkloda", "has no attribute 'Seg3DWorkloda' .*did you mean "
                                     "'Seg3DWorkload'"),
    ("seg3d.workload:np", "not a Workload subclass"),
    ("seg3d.workload:", "expected a kind name or 'package.module:Callable'"),
])
def test_import_path_errors(user_kinds, kind, message):
    with pytest.raises(ConfigError, match=message):
        build_job(_raw(kind))


def _hpcpar(args, cwd, env):
    return subprocess.run([sys.executable, "-m", "hpcpar.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_example_package_end_to_end(tmp_path):
    """Entry-point kind on 2 ranks == 1 rank; resume; import-path kind in a sweep + report."""
    _dist_info(tmp_path / "site")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(EXAMPLE)]))
    work = tmp_path / "work"
    work.mkdir()
    job = (EXAMPLE / "job.toml").read_text().replace('kind = "seg3d"', f'kind = "{EP_KIND}"')
    (work / "job.toml").write_text(job)
    for args in (["volumes.h5", "--samples", "6", "--size", "8"],
                 ["val.h5", "--seed", "1", "--samples", "2", "--size", "8"]):
        subprocess.run([sys.executable, "-m", "seg3d.make_data", *args], cwd=work, env=env,
                       check=True, timeout=120)
    losses = {}
    for n, grid in ((2, "1x2x1x1"), (1, "1x1x1x1")):
        p = _hpcpar(["run", "job.toml", "-n", str(n), "--grid", grid, "--run-dir", f"r{n}",
                     "--set", "train.steps=3"], work, env)
        assert p.returncode == 0, p.stderr
        assert p.stdout == f"r{n}\n"                        # the run directory, on stdout
        assert json.loads((work / f"r{n}" / "job.json").read_text())["job"]["model"]["kind"] \
            == EP_KIND
        losses[n] = json.loads((work / f"r{n}" / "metrics.json").read_text())
    for key in ("final_train_loss", "val_loss", "val_accuracy"):
        assert losses[2][key] == pytest.approx(losses[1][key], rel=1e-4, abs=1e-6), key
    p = _hpcpar(["run", "job.toml", "-n", "2", "--run-dir", "r2", "--set", "train.steps=5",
                 "--new-settings"], work, env)
    assert p.returncode == 0, p.stderr
    assert "resumed from step-000003 (step 3)" in p.stderr
    p = _hpcpar(["sweep", "job.toml", "--ranks", "1,2", "--out", "sw", "--set",
                 f"model.kind={IMPORT_KIND}", "--set", "grid.x=1", "--set", "grid.data=-1",
                 "--set", "train.steps=2"], work, env)
    assert p.returncode == 0, p.stdout + p.stderr
    table = (work / "sw" / "report" / "scaling.csv").read_text()
    assert table.count("\n") >= 3, table


def test_validation_of_a_workload_that_leaves_loss_value_unset():
    """``StepResult.loss_value`` is optional (``loss.item()`` when None): a user's volume kind
    whose ``forward_loss`` leaves it unset validates to the built-in kind's val_loss (it
    raised TypeError: None * int)."""
    import torch
    from mpi4py import MPI

    from hpcpar.parallel.grid import ProcessGrid
    from hpcpar.run.workloads.base import StepResult
    from hpcpar.run.workloads.volume import CosmoFlowWorkload

    class BareLoss(CosmoFlowWorkload):
        def forward_loss(self, model, batch):
            res = super().forward_loss(model, batch)
            return StepResult(loss=res.loss, samples=res.samples, extra=res.extra)

    job = build_job({
        "job": {"name": "bare"}, "grid": {"data": 1, "x": 1},
        "model": {"kind": "cosmoflow", "n_conv_blocks": 2, "base_filters": 4, "dense": [8]},
        "data": {"source": "synthetic", "size": 8, "channels": 1, "samples": 4,
                 "val_samples": 4},
        "train": {"steps": 1, "global_batch": 2}})
    losses = []
    for kind in (CosmoFlowWorkload, BareLoss):
        torch.manual_seed(0)
        w = kind(job, ProcessGrid(1, 1, 1, 1, comm=MPI.COMM_SELF), torch.device("cpu"))
        losses.append(w.evaluate(w.build_model()))
        w.close()
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    assert set(losses[0]) == {"val_loss", "val_mae"}
