"""``hpcpar run`` end to end through mpiexec: SIGUSR1 to the launcher -> checkpoint, exit 3 ->
rerun resumes -> final parameters bit-identical to an uninterrupted run; kill -9 of one rank ->
every rank gone and the launcher non-zero within 60 s, the last checkpoint intact and
resumable. Tiny jobs (16^3, 2 ranks)."""

import os
import signal
import time
from pathlib import Path

import torch

from hpcpar.run.checkpoint import store
from tests.support.cli_run import CliRun, alive, rank_pids, tiny_job_toml

JOB = tiny_job_toml(steps="{steps}", checkpoint="every = {every}\nkeep = 2")


class Run(CliRun):
    """``hpcpar run`` of the tiny job ``name`` (steps, checkpoint every) on 2 ranks."""

    def __init__(self, tmp: Path, name: str, steps: int, every: int, *extra: str):
        self.dir = tmp / name
        job = tmp / f"{name}.toml"
        job.write_text(JOB.format(steps=steps, every=every))
        super().__init__([job, "-n", "2", "--run-dir", self.dir, *extra], tmp / f"{name}.out")

    def rows(self) -> int:
        f = self.dir / "records" / "rank-00000.csv"
        return max(0, len(f.read_text().splitlines()) - 2) if f.exists() else 0


def final_params(run_dir: Path) -> dict:
    newest = store.list_checkpoints(run_dir / "checkpoints")[0]
    return torch.load(newest / "model.pt", weights_only=True)


def test_sigusr1_requeue_resume_bit_identical(tmp_path):
    ref = Run(tmp_path, "ref", steps=24, every=0)          # uninterrupted, alongside
    cut = Run(tmp_path, "cut", steps=24, every=0)
    try:
        assert cut.wait_until(lambda: cut.rows() >= 2), cut.log()
        cut.proc.send_signal(signal.SIGUSR1)
        rc = cut.finish(timeout=120)
        assert rc == 3, cut.log()
        assert "stopped by signal after checkpointing" in cut.log()
        (stopped_at,) = store.list_checkpoints(cut.dir / "checkpoints")
        assert 2 <= int(stopped_at.name.split("-")[1]) < 24
        again = Run(tmp_path, "cut", steps=24, every=0)     # same command: resumes
        assert again.finish() == 0, again.log()
        assert ref.finish() == 0, ref.log()
        assert "resumed from step-" in again.log()
    finally:
        ref.stop()
        cut.stop()
    a, b = final_params(ref.dir), final_params(cut.dir)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed run differs from uninterrupted"
    import json

    meta = json.loads((cut.dir / "meta.json").read_text())
    assert meta["status"] == "ok" and len(meta["segments"]) == 2
    from hpcpar.formats.records import read_steps

    steps = read_steps(cut.dir)
    assert sorted(set(steps["step"])) == list(range(24)) and len(steps) == 48


def test_kill9_one_rank_stops_all_and_checkpoint_resumes(tmp_path):
    run = Run(tmp_path, "k", steps=400, every=2)
    try:
        assert run.wait_until(lambda: len(store.list_checkpoints(run.dir / "checkpoints")) >= 1
                              and run.rows() >= 4), run.log()
        pids = rank_pids(run.dir)
        assert len(pids) == 2, pids
        os.kill(pids[-1], signal.SIGKILL)
        t0 = time.monotonic()
        rc = run.proc.wait(timeout=60)
        assert rc != 0
        while any(alive(p) for p in pids) and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids), "a rank outlived the killed one by 60 s"
    finally:
        run.stop()
    newest = store.list_checkpoints(run.dir / "checkpoints")[0]
    store.verify(newest)
    step = int(newest.name.split("-")[1])
    resumed = Run(tmp_path, "k", step + 2, 2, "--new-settings")   # steps, every
    assert resumed.finish() == 0, resumed.log()
    assert f"resumed from {newest.name}" in resumed.log()
