"""sbatch rendering without a cluster: golden scripts per site profile, quoting, the batch
script's requeue logic (run by bash against stub srun/scontrol), site profiles, planning errors.

Regenerate the golden files after an intended change with
``HPCPAR_REGEN_GOLDEN=1 python -m pytest tests/launch/test_sbatch.py`` and review the diff.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpcpar import _env
from hpcpar.errors import LaunchError
from hpcpar.launch.sbatch import sbatch_quote, shell_quote
from hpcpar.launch.site import available, load_site
from hpcpar.launch.submit import parse_after, plan_submit
from hpcpar.testing.slurm import read_argv, write_stub_python, write_test_job

# shipped_profiles_only: a fixture of tests/conftest.py (hpcpar.testing.slurm)
pytestmark = pytest.mark.usefixtures("shipped_profiles_only")

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "sbatch"
PYTHON = "/opt/venv/bin/python"
NASTY = """a b 'q' "dq" $(touch PWNED) `id` \\x #c %j;&|<>*?~"""

# name -> (site, plan_submit keyword arguments); "-report" suffix picks the report script
CASES = {
    "generic": ("generic", dict(ranks=[2])),
    "generic-array": ("generic", dict(ranks=[1, 2, 4], array=True, report=True)),
    "generic-report": ("generic", dict(ranks=[1, 2, 4], array=True, report=True)),
    "perlmutter": ("perlmutter", dict(nodes=[2], sets=["resources.account=m1234"])),
    "perlmutter-report": ("perlmutter", dict(nodes=[1, 2], report=True,
                                             sets=["resources.account=m1234"])),
    "frontier": ("frontier", dict(nodes=[2], time="02:00:00",
                                  sets=["resources.account=ABC123"])),
}


@pytest.fixture()
def job(tmp_path):
    return write_test_job(tmp_path / "cosmo.toml")


def _render(tmp_path, job, name) -> str:
    site, kw = CASES[name]
    jobs = plan_submit(job, tmp_path / "sweep", site=site, python=PYTHON, **kw)
    pick = jobs[-1] if name.endswith("-report") else jobs[-1 if len(jobs) == 1 else 0]
    if name.endswith("-report"):
        assert pick.kind == "report"
    # machine-independent paths in the golden files (--chdir: where submit ran)
    return pick.text.replace(str(tmp_path), "/scratch/user").replace(str(Path.cwd()),
                                                                      "/home/user/project")


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(tmp_path, job, name):
    text = _render(tmp_path, job, name)
    path = GOLDEN / f"{name}.sbatch"
    if _env.get("HPCPAR_REGEN_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing {path}: run HPCPAR_REGEN_GOLDEN=1 pytest {__file__}"
    assert text == path.read_text(), f"{path} differs: regenerate and review the diff"
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_site_recommendations(tmp_path, job):
    """The flags those sites' documentation asks for (NERSC, OLCF)."""
    pm = _render(tmp_path, job, "perlmutter")
    for want in ("#SBATCH --constraint=gpu", "#SBATCH --qos=regular", "#SBATCH --nodes=2",
                 "#SBATCH --ntasks-per-node=4", "#SBATCH --cpus-per-task=32",
                 "#SBATCH --gpus-per-node=4", "export MPICH_GPU_SUPPORT_ENABLED=1",
                 "--cpu-bind=cores", "--gpus-per-task=1 --gpu-bind=none",
                 "module load PrgEnv-gnu cudatoolkit craype-accel-nvidia80",
                 "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue", "--ntasks=8"):
        assert want in pm, want
    assert "--mpi=" not in pm   # Cray MPICH: the site's default PMI
    fr = _render(tmp_path, job, "frontier")
    for want in ("#SBATCH --partition=batch", "#SBATCH --ntasks-per-node=8",
                 "#SBATCH --cpus-per-task=7", "--gpus-per-task=1 --gpu-bind=closest",
                 "export MPICH_GPU_SUPPORT_ENABLED=1", "craype-accel-amd-gfx90a", "--ntasks=16",
                 "#SBATCH --account=ABC123", "#SBATCH --time=02:00:00"):
        assert want in fr, want
    gen = _render(tmp_path, job, "generic")
    assert "--mpi=pmi2" in gen and "--gpus" not in gen and "--cpus-per-task=1" in gen


def test_scripts_run_where_submit_ran(tmp_path, job, monkeypatch):
    """Issue 64: every script (points, array, report) has ``--chdir`` = the directory
    ``submit`` ran in, so a job's relative paths do not depend on where sbatch runs it."""
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    jobs = plan_submit(job, tmp_path / "sweep", site="generic", python=PYTHON, ranks=[1, 2],
                       report=True)
    assert len(jobs) == 3
    for j in jobs:
        assert f"#SBATCH --chdir={tmp_path / 'here'}\n" in j.text, j.label


def test_gpus_are_sized_to_the_ranks_per_node(tmp_path, job):
    """Issue 64: on 4-GPU nodes, a 2-rank point asks for 2 GPUs, a 4-rank one for 4; an
    array asks for its largest point's; a job's own gpus_per_node is taken as it is."""
    def gpus(**kw):
        jobs = plan_submit(job, tmp_path / "sweep", site="perlmutter", python=PYTHON,
                           sets=["resources.account=m1", *kw.pop("sets", [])], **kw)
        return [next(ln for ln in j.text.splitlines() if "--gpus-per-node" in ln)
                for j in jobs]
    assert gpus(ranks=[1, 2, 8]) == [f"#SBATCH --gpus-per-node={g}" for g in (1, 2, 4)]
    assert gpus(ranks=[1, 2], array=True) == ["#SBATCH --gpus-per-node=2"]
    assert gpus(ranks=[2], sets=["resources.gpus_per_node=4"]) == \
        ["#SBATCH --gpus-per-node=4"]


def test_sbatch_quote():
    assert sbatch_quote("m1234") == "m1234"
    assert sbatch_quote('a "b" \\c') == '"a \\"b\\" \\\\c"'
    assert sbatch_quote("x # y") == '"x # y"'
    for bad in ("a\nb", "a\0b"):
        with pytest.raises(LaunchError):
            sbatch_quote(bad)
        with pytest.raises(LaunchError):
            shell_quote(bad)


def _fake_slurm(bin_dir: Path, log: Path) -> None:
    """srun runs its command after the options; scontrol logs its arguments."""
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [ "${1#-}" != "$1" ]; do shift; done\n'
                                  'exec "$@"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "scontrol $*" >> {shell_quote(log)}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)


@pytest.mark.parametrize("behaviour,signal,max_requeues,rc,requeued", [
    ("ok", None, None, 0, False),
    ("fail", None, None, 1, False),
    ("preempt", "USR1", None, 0, True),    # USR1 -> ranks exit 3 -> requeue, exit 0
    ("preempt", "USR1", 0, 3, False),      # requeue limit reached: exit 3 for the user
    ("preempt", "TERM", None, 143, False),  # scancel/time limit: never requeue from here
])
def test_script_logic(tmp_path, job, behaviour, signal, max_requeues, rc, requeued):
    """Run the rendered script with bash (fake srun/scontrol): literal arguments, signal
    forwarding, requeue only after a checkpoint exit and within the limit."""
    import signal as signals
    import time

    out = tmp_path / NASTY.replace("\\", "")   # backslashes are refused in --out (below)
    sets = [f"job.name={behaviour} {NASTY}", "train.steps=3"]
    text = plan_submit(job, out, ranks=[1], python=str(write_stub_python(tmp_path / "py")),
                       sets=sets, max_requeues=max_requeues)[0].text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    log = tmp_path / "scontrol.log"
    _fake_slurm(tmp_path / "bin", log)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", SLURM_JOB_ID="42",
               SLURM_JOB_NODELIST="n1")
    env.pop("SLURM_RESTART_COUNT", None)
    proc = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = out / "ranks-1"
    if signal:
        deadline = time.monotonic() + 20
        while not (run_dir / "ready.0.0").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(getattr(signals, f"SIG{signal}"))   # to the batch shell, as Slurm
    stdout = proc.communicate(timeout=30)[0]
    assert proc.returncode == rc, stdout
    assert (log.exists() and "scontrol requeue 42" in log.read_text()) == requeued, stdout
    if signal == "USR1":
        assert (run_dir / "checkpointed.0.0").exists(), stdout
    argv = read_argv(run_dir / "argv.0.0")
    assert argv[:3] == ["-m", "hpcpar.cli", "run"]
    assert argv[3] == str(job) and argv[4:7] == ["--run-dir", str(run_dir), "--resume"]
    assert argv[7:] == ["--grid", "1x1x1x1"] + [x for s in sets for x in ("--set", s)]
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


def test_sites_and_errors(tmp_path, job, monkeypatch):
    assert {"generic", "perlmutter", "frontier"} <= set(available())
    for name in available():
        load_site(name)
    with pytest.raises(LaunchError, match="did you mean 'perlmutter'"):
        load_site("perlmuter")
    bad = tmp_path / "sites"
    bad.mkdir()
    (bad / "mine.toml").write_text('[node]\ngpu = 4\n')
    monkeypatch.setenv("HPCPAR_SITE_PATH", str(bad))
    with pytest.raises(LaunchError, match=r"\[node\] unknown key 'gpu' \(did you mean 'gpus'"):
        load_site("mine")
    (bad / "mine.toml").write_text('[node]\ngpus = "4"\n')
    with pytest.raises(LaunchError, match="expected an integer"):
        load_site(str(bad / "mine.toml"))
    (bad / "mine.toml").write_text('[node]\ngpus = 2\ntasks_per_node = 2\ncpus = 16\n'
                                   '[srun]\ngpu_options = ["--gpus-per-task=1"]\n')
    text = plan_submit(job, tmp_path / "o", site="mine", nodes=[4], python=PYTHON)[0].text
    assert "--ntasks=8" in text and "--cpus-per-task=8" in text and "--gpus-per-task=1" in text
    with pytest.raises(LaunchError, match="tasks_per_node"):
        plan_submit(job, tmp_path / "o", nodes=[2])
    with pytest.raises(LaunchError, match="not both"):
        plan_submit(job, tmp_path / "o", nodes=[2], ranks=[2])
    with pytest.raises(LaunchError, match="backslash"):
        plan_submit(job, tmp_path / "a\\b", ranks=[2])
    with pytest.raises(LaunchError, match="Slurm time"):
        plan_submit(job, tmp_path / "o", ranks=[2], time="soon")
    weak = plan_submit(job, tmp_path / "o", ranks=[2, 1], weak=True, array=True)[0].text
    assert "0) RANKS=1 NODES=1" in weak and \
        "POINT_ARGS=(--grid 2x1x1x1 --set train.global_batch=128)" in weak
    assert parse_after(["12", "afterany:13:14", "15,16"]) == \
        "afterok:12,afterany:13:14,afterok:15,afterok:16"
    with pytest.raises(LaunchError, match="job id"):
        parse_after(["12; rm -rf /"])


def test_cli_dry_run(tmp_path, job, capsys, cli_main):
    cli_main(["submit", str(job), "--out", str(tmp_path / "o"), "--site", "frontier",
          "--nodes", "1,2", "--report", "--dry-run"])
    text = capsys.readouterr().out
    assert text.count("#!/bin/bash") == 3 and "--dependency=afterany:" in text
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit) as exc:
        cli_main(["submit", str(job), "--out", str(tmp_path / "o"), "--site", "nowhere",
              "--dry-run"])
    assert exc.value.code == 2
    assert "unknown site 'nowhere'" in capsys.readouterr().err


def test_submit_records_and_status_without_slurm(tmp_path, job, monkeypatch):
    """submit() with a fake sbatch: scripts written, report after the runs (afterany),
    jobs.json records; status falls back to the run directories when Slurm is unreachable."""
    from hpcpar.launch.submit import submit, sweep_status

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        f'#!/bin/bash\necho "$*" >> {tmp_path}/sbatch.log\n'
        f'n=$(wc -l < {tmp_path}/sbatch.log); echo "$((100 + n));cluster"\n')
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 'slurm_load_jobs error' >&2; exit 1\n")
    (bin_dir / "sacct").write_text("#!/bin/bash\nexit 1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    out = tmp_path / "sweep"
    recs = submit(plan_submit(job, out, ranks=[1, 2], report=True, after=["77"]), out)
    assert [(r["id"], r["label"]) for r in recs] == \
        [("101", "ranks-1"), ("102", "ranks-2"), ("103", "report")]
    calls = (tmp_path / "sbatch.log").read_text().splitlines()
    assert calls[0].startswith("--parsable --dependency=afterok:77 ")
    assert calls[2] == f"--parsable --dependency=afterany:101:102 {out}/slurm/report.sbatch"
    (out / "ranks-2").mkdir()
    (out / "ranks-2" / "metrics.json").write_text("{}")
    rows = sweep_status(out)
    assert [r["run"] for r in rows] == ["-", "finished", "-"]
    assert all(r["state"] == "UNKNOWN" and "scontrol" in r["reason"] for r in rows)
