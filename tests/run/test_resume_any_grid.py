"""A checkpoint resumes on any grid that fits the job (issue 31, item 1), through real
``hpcpar run`` processes: a run preempted after every 2 steps and resumed each time with
``--grid`` on 1x2x1x1 -> 1x1x2x1 -> 1x1x1x1 -> 2x2x1x1 (the last on 2 virtual nodes) ends with
the parameters and optimizer state of one uninterrupted single-process run; the dense head is
tensor-parallel, so its weights and Adam state are sharded differently on every grid. A grid
whose split does not fit the sample is one line, exit code 2, before anything changes."""

from pathlib import Path

import torch

from hpcpar.run.checkpoint.store import list_checkpoints
from tests.support.cli_run import CliRun, tiny_job_toml, tree_hashes

GRIDS = ["1x2x1x1", "1x1x2x1", "1x1x1x1", "2x2x1x1"]
STEPS_PER_SEGMENT = 2

#: a CosmoFlow kind preempted in every segment: SIGUSR1 on rank 0 during its 2nd step, so the
#: ranks checkpoint after that step and exit 3, as a requeued job does
STOPPER = '''
import os
import signal

from hpcpar.run.workloads.volume import CosmoFlowWorkload


class StopAfterTwo(CosmoFlowWorkload):
    def forward_loss(self, model, batch):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2 and self.grid.rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        return super().forward_loss(model, batch)
'''

#: the tiny job with a tensor-parallel head (Linear 256->16->4 split over x, y, z)
TP = "dense = [16]\ntensor_parallel = true\ntp_min_features = 4"


def _job(tmp: Path, name: str, kind: str, steps: int) -> Path:
    path = tmp / name
    path.write_text(tiny_job_toml(x=1, kind=kind, steps=str(steps)).replace("dense = [16]", TP))
    return path


def _run(tmp: Path, args, name: str, env=None) -> tuple[int, str]:
    run = CliRun(args, tmp / f"{name}.out", cwd=tmp, env=env)
    rc = run.finish(timeout=240)
    return rc, run.log()


def _newest(run_dir: Path, name: str) -> dict:
    return torch.load(list_checkpoints(run_dir / "checkpoints")[0] / name, weights_only=True)


def test_resume_chain_across_grids_equals_an_uninterrupted_run(tmp_path):
    steps = STEPS_PER_SEGMENT * len(GRIDS)
    (tmp_path / "stopper.py").write_text(STOPPER)
    job = _job(tmp_path, "chain.toml", "stopper:StopAfterTwo", steps)
    previous = None
    for i, grid in enumerate(GRIDS):
        env = {"HPCPAR_FAKE_NODES": "2"} if grid == GRIDS[-1] else None
        rc, out = _run(tmp_path, [job, "--run-dir", "chain", "--grid", grid], f"seg{i}", env)
        last = i == len(GRIDS) - 1
        assert rc == (0 if last else 3), out
        step = STEPS_PER_SEGMENT * i
        said = [line for line in out.splitlines() if "resuming step" in line]
        if previous is None:
            assert said == [], out
        else:   # what changed, in one line, before the ranks start
            assert said == [f"hpcpar: resuming step {step} of grid {previous} on grid {grid}"], \
                out
            assert f"resumed from chain/checkpoints/step-{step:06d} at step {step}" in out, out
        previous = grid

    ref_job = _job(tmp_path, "ref.toml", "cosmoflow", steps)
    rc, out = _run(tmp_path, [ref_job, "--run-dir", "ref", "--grid", "1x1x1x1"], "ref")
    assert rc == 0, out

    chain, ref = tmp_path / "chain", tmp_path / "ref"
    assert list_checkpoints(chain / "checkpoints")[0].name == f"step-{steps:06d}"
    # Not bitwise: every grid but 1x1x1x1 sums gradients (over data ranks, spatial pieces and
    # tensor-parallel blocks) in another order than one process, ~1 float32 ulp per step, and
    # Adam's v^-1/2 amplifies it where a gradient is near 0. The same bound as the loop's own
    # 2-data-ranks-vs-1 test (tests/run/test_train.py) for the same 8 Adam steps; measured
    # here: 2.7e-7 absolute at most. A wrong resume (lost Adam state, another sample, a
    # shard of another rank) moves parameters by ~lr = 3e-3 per step.
    a, b = _newest(chain, "model.pt"), _newest(ref, "model.pt")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=2e-5, atol=2e-6, msg=k)
    oa, ob = _newest(chain, "trainer.pt")["optimizer"], _newest(ref, "trainer.pt")["optimizer"]
    assert oa["state"].keys() == ob["state"].keys()
    for i, state in oa["state"].items():
        for key, value in state.items():   # full-shape moments: the checkpoint is global
            torch.testing.assert_close(value, ob["state"][i][key], rtol=1e-4, atol=1e-6,
                                       msg=f"param {i} {key}")


def test_a_grid_whose_split_does_not_fit_the_sample_is_one_line(tmp_path):
    job = tmp_path / "small.toml"
    job.write_text(tiny_job_toml(x=1, steps="1").replace("size = 16", "size = 2")
                   .replace("n_conv_blocks = 2", "n_conv_blocks = 1"))
    rc, out = _run(tmp_path, [job, "--run-dir", "small"], "first")
    assert rc == 0, out
    before = tree_hashes(tmp_path / "small")
    rc, out = _run(tmp_path, [job, "--run-dir", "small", "--grid", "1x3x1x1"], "refused")
    assert rc == 2, out
    assert out.splitlines() == [f"hpcpar: error: {job}: [grid] x = 3: more parts than the "
                                f"sample has voxels on that axis ([data] size = 2); use "
                                f"x <= 2"], out
    assert tree_hashes(tmp_path / "small") == before
