"""The run-directory fuzzer (issue 67): seeded random sequences of ``hpcpar run`` / a stop /
a plain resume / ``--new-settings`` / ``--from`` another run's checkpoint / ``--fresh``, each
with randomly changed ``[train]`` lr, steps, lr_schedule and weight_decay, on one run
directory that also holds the user's own files. Real ``hpcpar run`` processes.

After every operation the rule "the settings in force are the ones recorded, and no file
outside hpcpar's own is touched" is checked: exit 0 or 3 (stopped), or 2 with one error line
and nothing changed, never a traceback; the user's files (and the other run) byte-identical;
every entry of the run directory the user's, hpcpar's (its mark lists it) or a ``--fresh``
``previous-*``; ``job.json`` holds the settings passed to the last run that trained; each step
record's ``lr`` the job's schedule at that step (steps before the resume as they were); the
last checkpoint's optimizer the job's; a ``metrics.json`` only in a finished run (meta.json
"ok"), of the job.json's steps, never one left by earlier settings beside a stopped segment.

The seeds are fixed (a failing case is named by its test id and replays the same); an
operation's expected outcome follows from the sequence so far, so a refusal where a run was
due (or the reverse) fails too.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpcpar.errors import EXIT_USAGE
from hpcpar.formats.records.reader import read_steps
from hpcpar.run._optim import LRFactor
from tests.support.cli_run import micro_job_toml

pytestmark = pytest.mark.slow

SEEDS = (0, 1, 2)           # ~1 minute each on 2 cores: the CI budget
OPERATIONS = 6              # per sequence
EXIT_STOPPED = 3            # a run stopped by a signal after checkpointing (requeue)
STOP = "RUNDIR_FUZZ_STOP_AT"
JOB = micro_job_toml("fz", kind="stopper:StopAt", checkpoint="every = 1\nkeep = 100",
                     train="warmup_steps = 1\nlr_step_every = 2\nlr_gamma = 0.5")

#: CosmoFlow whose rank 0 asks itself to stop (SIGUSR1, as a scheduler's preemption does) in
#: the N-th step of the segment (N from the environment): it checkpoints after that step and
#: exits 3
STOPPER = f'''
import os
import signal

from hpcpar.run.workloads.volume import CosmoFlowWorkload


class StopAt(CosmoFlowWorkload):
    def forward_loss(self, model, batch):
        self.calls = getattr(self, "calls", 0) + 1
        if str(self.calls) == os.environ.get("{STOP}") and self.grid.rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        return super().forward_loss(model, batch)
'''

#: the user's own files beside the run directory, and those the user adds to it once it is
#: one (a directory holding only these would not be one: hpcpar refuses to run in it)
USER_FILES = {"notes.md": "- what to try next\n"}
USER_RUN_FILES = {"run/notes.txt": "what I saw in this run\n",
                  "run/plots/loss.py": "import matplotlib\n", "run/plots/data.csv": "1,2\n"}
DONOR_STEPS = 8
DONOR = {"lr": 0.003, "steps": DONOR_STEPS, "lr_schedule": "cosine", "weight_decay": 0.05}


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "dir" for p in sorted(root.rglob("*"))
            if p.name != "hpcpar.lock"}


def hpcpar_run(root: Path, settings: dict, *extra, stop: int | None = None):
    sets = [a for k, v in settings.items() for a in ("--set", f"train.{k}={v!r}")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop(STOP, None)
    if stop is not None:
        env[STOP] = str(stop)
    return subprocess.run([sys.executable, "-m", "hpcpar.cli", "run", "job.toml", "-n", "1",
                           *sets, *map(str, extra)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)


def lr_at(settings: dict, step: int) -> float:
    """The lr of (0-based) step ``step`` under the job's schedule, by the library's own
    schedule function (the rule the records are checked against, not their values)."""
    train = SimpleNamespace(**{**TRAIN_DEFAULTS, **settings})
    return settings["lr"] * LRFactor(train, settings["steps"])(step)


TRAIN_DEFAULTS = {"warmup_steps": 1, "lr_step_every": 2, "lr_gamma": 0.5, "min_lr": 0.0}


def draw_settings(rng: random.Random) -> dict:
    return {"lr": rng.choice([0.004, 0.002, 0.001]),
            "steps": rng.randint(3, 8),
            "lr_schedule": rng.choice(["constant", "cosine", "step", "warmup"]),
            "weight_decay": rng.choice([0.0, 0.01, 0.25])}


@pytest.fixture(scope="module")
def donor(tmp_path_factory) -> Path:
    """Another run, finished, a checkpoint at every step: what ``--from`` resumes."""
    root = tmp_path_factory.mktemp("donor")
    (root / "job.toml").write_text(JOB)
    (root / "stopper.py").write_text(STOPPER)
    r = hpcpar_run(root, DONOR, "--run-dir", "run")
    assert r.returncode == 0, r.stderr
    return root / "run"


class Sequence:
    """One run directory and what the operations so far make it hold."""

    def __init__(self, root: Path, donor: Path, rng: random.Random):
        self.root, self.donor, self.rng = root, donor, rng
        self.run = root / "run"
        self.recorded: dict | None = None     # job.json's settings
        self.reached = 0                      # the latest checkpoint's step
        self.finished = False
        self.lrs: dict[int, float] = {}       # step -> lr the records hold
        (root / "job.toml").write_text(JOB)
        (root / "stopper.py").write_text(STOPPER)
        self.user: dict = {}
        self._add_user_files(USER_FILES)
        self.donor_files = snapshot(donor)
        self.log: list[str] = []

    def _add_user_files(self, files: dict) -> None:
        for name, text in files.items():
            (self.root / name).parent.mkdir(parents=True, exist_ok=True)
            (self.root / name).write_text(text)
        self.user.update({k: v for k, v in snapshot(self.root).items() if k in files})

    # -- the operations: (arguments, expected start step or None for a refusal) -------------
    def step(self) -> None:
        rng = self.rng
        kind = rng.choice(["run", "from"] if self.recorded is None
                          else ["run", "resume", "new", "from", "fresh"])
        settings, extra, start = self._plan(kind)
        stop = None                 # stopped in the n-th step of the segment, before its last
        if isinstance(start, int) and settings["steps"] - start > 1 and rng.random() < 0.4:
            stop = rng.randint(1, settings["steps"] - start - 1)
        self.log.append(f"{kind} {settings} {' '.join(map(str, extra))} stop={stop} "
                        f"-> expected start {start}")
        before = snapshot(self.root)
        r = hpcpar_run(self.root, settings, "--run-dir", "run", *extra, stop=stop)
        context = "\n".join(self.log) + "\n" + r.stderr
        assert "Traceback" not in r.stderr, context
        if start is None:
            self._refused(r, before, context)
        elif start == "done":
            assert r.returncode == 0 and "already finished" in r.stderr, context
            assert snapshot(self.root) == before, context
        else:
            self._trained(r, settings, start, stop, kind == "fresh", context)
        self._untouched(context)

    def _plan(self, kind: str):
        rng, recorded = self.rng, self.recorded
        if kind == "resume":        # the same settings: continue (or nothing to do)
            return dict(recorded), [], "done" if self.finished else self.reached
        if kind == "run":           # settings as drawn: new, the same, or refused as changed
            settings = draw_settings(rng) if recorded is None or rng.random() < 0.5 \
                else dict(recorded)
            if recorded is None:
                return settings, [], 0
            if settings != recorded:
                return settings, [], None
            return settings, [], "done" if self.finished else self.reached
        if kind == "new":
            settings = draw_settings(rng)
            if settings == recorded:
                settings["lr"] /= 2
            return settings, ["--new-settings"], self.reached if settings["steps"] > \
                self.reached else None
        if kind == "from":
            k = rng.randint(1, DONOR_STEPS - 1)
            settings = draw_settings(rng)
            flags = ["--from", self.donor / "checkpoints" / f"step-{k:06d}"]
            if recorded is not None:
                flags.append("--new-settings")
            return settings, flags, k if settings["steps"] > k else None
        assert kind == "fresh"
        return draw_settings(rng), ["--fresh"], 0

    # -- the checks -------------------------------------------------------------------------
    def _refused(self, r, before: dict, context: str) -> None:
        assert r.returncode == EXIT_USAGE, context
        errors = [line for line in r.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and errors[0].startswith("hpcpar: error: "), context
        assert snapshot(self.root) == before, context        # a refusal changes nothing

    def _trained(self, r, settings: dict, start: int, stop, fresh: bool, context: str):
        assert r.returncode == (EXIT_STOPPED if stop else 0), context
        assert f"steps {start}->{settings['steps']}" in r.stderr, context
        reached = start + stop if stop else settings["steps"]
        job = json.loads((self.run / "job.json").read_text())["job"]["train"]
        assert {k: job[k] for k in settings} == settings, context
        # the records: the earlier segments' steps before the resume as they were, then the
        # job's schedule from the resume on
        lrs = {} if fresh else {s: v for s, v in self.lrs.items() if s < start}
        lrs.update({s: lr_at(settings, s) for s in range(start, reached)})
        steps = read_steps(self.run)
        assert dict(zip(steps["step"].tolist(), steps["lr"].tolist(), strict=True)) == lrs, \
            context
        trainer = torch.load(self.run / "checkpoints" / f"step-{reached:06d}" / "trainer.pt",
                             weights_only=True)
        (group,) = trainer["optimizer"]["param_groups"]
        assert group["weight_decay"] == settings["weight_decay"], (group, context)
        assert group["initial_lr"] == settings["lr"], (group, context)
        meta = json.loads((self.run / "meta.json").read_text())
        assert meta["status"] == ("preempted" if stop else "ok"), context
        assert (self.run / "metrics.json").exists() != bool(stop), context
        if fresh:
            assert list(self.run.glob("previous-*")), context
        self.recorded, self.reached, self.finished, self.lrs = settings, reached, not stop, lrs
        if not any(k in self.user for k in USER_RUN_FILES):
            self._add_user_files(USER_RUN_FILES)

    def _untouched(self, context: str) -> None:
        now = snapshot(self.root)
        assert {k: now.get(k) for k in self.user} == self.user, context
        assert snapshot(self.donor) == self.donor_files, context      # --from only reads it
        if self.recorded is None:       # no run yet: nothing made
            assert not self.run.exists(), context
            return
        if (self.run / "metrics.json").exists():    # a result only of the recorded settings
            metrics = json.loads((self.run / "metrics.json").read_text())
            job = json.loads((self.run / "job.json").read_text())["job"]["train"]
            assert metrics["steps"] == job["steps"] == self.recorded["steps"], context
            assert json.loads((self.run / "meta.json").read_text())["status"] == "ok", context
        mark = json.loads((self.run / "hpcpar-run.json").read_text())
        for name in os.listdir(self.run):
            assert (name in ("notes.txt", "plots", "hpcpar-run.json", "hpcpar.lock")
                    or name.startswith("previous-")
                    or any(fnmatch.fnmatchcase(name, p) for p in mark["entries"])), \
                (name, context)
        outside = {k.split("/")[0] for k in now}
        assert outside <= {"job.toml", "stopper.py", "notes.md", "run", "__pycache__"}, \
            (outside, context)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_sequence_keeps_the_recorded_settings_in_force(tmp_path, donor, seed):
    seq = Sequence(tmp_path, donor, random.Random(seed))
    for _ in range(OPERATIONS):
        seq.step()
    print(f"seed {seed}:", *seq.log, sep="\n  ")      # the sequence run (pytest -s)
